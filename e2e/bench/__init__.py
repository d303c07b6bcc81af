"""Benchmarks: scripts that measure and print numbers (``python -m e2e.bench.<name>``).

Speed and memory targets are checked here, never by timed assertions in tests; tests run
each benchmark briefly to keep it working. ``stats`` holds the few statistics they report
(the chaos campaign and the GPU benchmark report with it too).
"""
