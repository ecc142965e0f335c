"""Loaded models: the runtime of one model (load, speculation, calibration), its compute thread
and scheduler, the model set, statistics.
"""
