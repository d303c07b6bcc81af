"""Long randomized runs that look for what a test's few cases miss: the soak of rota on a
real node (``soak``) and the driver crash campaign (``driver_crash``). The chaos campaign
(``e2e.chaos``) and the scale run (``e2e.scale``) are packages of their own beside this.
"""
