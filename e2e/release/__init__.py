"""Release and registry tools: the artifacts built into ``dist/`` (``python -m e2e.release``,
``artifacts``), the OCI registry on loopback and what is pushed, signed and verified there
(``registry``, ``publish``), and the Helm chart rendered from Python (``chart``,
``chart_readme``).
"""
