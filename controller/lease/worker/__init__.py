"""The parts of one GPU's worker (:class:`controller.lease.gpu.GpuWorker`), each with one
job: ``state`` (what the parts share), ``callers`` (the callers' queue), ``accounting``
(the holder's work, tenure and switch costs), ``policy_view`` (what the switch policy is
asked), ``turns`` (the turn loop: whom to serve, what stands before the switch, and the
switch), ``gangs`` (switches and starts over several GPUs), ``start_gate`` (start-up
admission), ``reconciler`` (reconciliation), ``idle`` (keep-alive and the home return),
``outcomes`` (a finished switch taken in) and ``lease_port`` (the GPU Lease's reads and
writes)."""
