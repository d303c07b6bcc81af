"""The contracts between rota's processes, importable without the processes.

A module here describes what one process writes and another reads (a Kubernetes object, an
API's bodies), with its parser, its renderer and the rules readers apply to it. It imports
the standard library, pydantic and the other modules here only: never a process
(:mod:`controller.lease`, :mod:`controller.gateway`, :mod:`controller.guard`), which
``tests/test_layering.py`` checks.
"""
