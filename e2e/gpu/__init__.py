"""rota's switch protocol on a GPU without a cluster (``python -m e2e.bench.gpu``): on engine
simulators, one GPU or, with ``--tensor-parallel N``, gang switches over N GPUs
(``switch_cli``, ``switch_run``, ``gang_run``, ``switch_summary``, ``switch_ports``,
``simulators``, ``bandwidth``, ``one_awake``); with real vLLM engines (``--engine vllm``:
``bench``, ``scenarios`` and the modules they use); the stage driver for GPU machines
(``e2e/gpu/run.sh``), and the small helpers they run there. Modules here that run before
rota's dependencies are installed (``shapes``, ``h2d``, ``weights``, ``ballast``) use the
standard library and PyTorch only."""
