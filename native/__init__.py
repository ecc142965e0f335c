"""meshd.native: everything that touches llama.cpp, nothing about sockets or requests."""

from .cpus import apply_wait_policy_default

# Before any submodule loads llama.cpp (and with it the OpenMP runtime, which reads its
# wait policy once): llama.cpp's threads sleep at barriers unless the user says otherwise.
apply_wait_policy_default()
