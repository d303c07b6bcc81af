"""Tools a person runs by hand: the embedded demo (``make demo``), the NVML recorder for the
fake backend's fixtures, and the reader of vLLM's route table from a wheel.
"""
