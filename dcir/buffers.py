"""What a module buffer holds for a parameter: the declaration attributes that say so.

Below the memory model and the stretch cutter (``dcir.memory``, ``dcir.fusion``), which
both tell buffers apart by them, as do the passes that declare them and the lowering.
"""

#: A buffer that holds a gathered copy of a parameter (``unshard`` across micro-steps):
#: ``buffer @w.unsharded : f32[4, 8] {unshard.of = @w}``. It is the schedule's memory.
UNSHARD_OF = "unshard.of"

#: A buffer that sums a parameter's full gradient across micro-steps (``zero1``):
#: ``buffer @w.grad_acc : f32[4, 8] {grad_acc.of = @w}``. It is the schedule's memory too.
GRAD_ACC_OF = "grad_acc.of"

#: A buffer that holds one of a parameter's optimizer state tensors (``offload``), on the
#: device (``shard<...>``) or in host memory (``host<shard<...>>``):
#: ``buffer @w.exp_avg : host<shard<f32[4, 8], 2>> {optim.state_of = @w, optim.key = "exp_avg"}``.
#: State is the optimizer's, not the schedule's; ``offload`` accounts for it.
OPTIM_STATE_OF, OPTIM_KEY = "optim.state_of", "optim.key"
