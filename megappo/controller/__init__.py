"""The single controller: Ray placement (resource pools), worker groups and how a driver call is
spread over a group's workers (dispatch). It knows Ray and each worker's Megatron (dp, pp, tp)
coordinates, nothing of PPO: the driver (megappo.ppo) creates groups of worker classes
(megappo.workers), which subclass `Worker` and mark their driver-callable methods with `register`.

resource_pool.py   RayResourcePool (one placement group per node), ResourcePoolManager, WorkerError
worker_group.py    RayWorkerGroup, NVMegatronRayWorkerGroup (megatron-aware dispatch), PendingCall
dispatch.py        Dispatch modes, the pure CallPlan of each mode, register()
worker.py          Worker: the base class of every worker process (rank, world, master address)
"""
