"""The contracts between rota's processes, importable without the processes.

A module here describes what one process writes and another reads (a Kubernetes object, an
API's bodies), with its parser, its renderer and the rules readers apply to it. It imports
the standard library, pydantic and rota's other pure contract modules only
(:mod:`controller.naming`, :mod:`controller.leases`): never a process (the lease
controller's modules, :mod:`controller.gateway`, :mod:`controller.guard`), which
``tests/test_layering.py`` checks.
"""
