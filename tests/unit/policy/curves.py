"""Cost curves measured on a real machine, shared by the policy and proposer tests."""

from __future__ import annotations

from meshd.policy.costs import CostCurve

# Measured on the project's 2-core benchmark machine (SmolLM2 Q4_1), keyed by batch rows.
Q4_1 = CostCurve.from_row_costs({2: 1.75, 3: 2.32, 4: 3.40, 8: 5.40})
Q8_0 = CostCurve.from_row_costs({2: 1.38, 3: 1.60, 4: 1.91, 5: 2.36})
