"""The lease controller: one per GPU node, it keeps one engine awake per GPU and names
it in the GPU's Lease (``python -m controller`` runs it)."""
