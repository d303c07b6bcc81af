"""The runtime kit of rota's processes: what the DRA kubelet plugin, the lease controller
and the gateway all need and none of them owns. It imports the contracts (:mod:`rota.api`)
and generated messages (:mod:`rota.pb`) at most, never a process."""
