"""rota's switch protocol on a real GPU with real vLLM engines (``python -m e2e.bench_gpu
--engine vllm``), the stage driver for GPU machines (``e2e/gpu/run.sh``), and the small
helpers they run there. Modules here that run before rota's dependencies are installed
(``shapes``, ``h2d``, ``weights``, ``ballast``) use the standard library and PyTorch only."""
