"""One rank of a two-rank job whose last collective is freed by Gloo's thread as the script ends.

``python late_gloo_worker.py PORT RANK MODE`` (MODE ``bare`` or ``held``). Forces the teardown
order of the measured exit abort (``gradcomp.inflight``): rank 0 starts an allgather of large
Python-created tensors and drops every Python reference to them and to the work, so Gloo's
thread is their last owner. Rank 1 joins 2 s later; Gloo's thread on rank 0 then frees the tensors,
taking the GIL for each Python object and releasing it while the 256 MB buffer is freed. A weak
reference tells the main thread that the first one is being freed, and the script ends at once:
the main thread takes the GIL and begins finalizing while Gloo's thread is still inside the
tensor's destructor, which then cannot take the GIL back (``pthread_exit``, ``std::terminate``).
With MODE ``held`` the tensors are held by ``gradcomp.inflight`` first, as gradcomp holds every
tensor it hands to a collective: Gloo's thread never frees a Python object, and the exit waits.
"""
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist

ELEMENTS = 1 << 26  # 256 MB of float32: its free keeps Gloo's thread off the GIL for a while

port, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=2)
dist.barrier()
tensor = torch.ones(ELEMENTS) * rank
outputs = [torch.empty_like(tensor) for _ in range(2)]
if rank == 1:
    time.sleep(2.0)
    dist.all_gather(outputs, tensor)
    sys.exit(0)
if mode == "held":
    from gradcomp import inflight

    inflight.hold(tensor, *outputs)
freeing = []
weakref.finalize(outputs[0], freeing.append, True)  # runs on the thread that frees the tensor
work = dist.all_gather(outputs, tensor, async_op=True)
del outputs, tensor, work  # Gloo's thread is now the last owner (bare) or not (held)
# As a script that used DDP leaves it: the group destroyed, an object still referencing it, so
# CPython frees it while finalizing and joins Gloo's threads there.
group = dist.group.WORLD
dist.destroy_process_group()
deadline = time.time() + (30.0 if mode == "bare" else 4.0)
while not freeing and time.time() < deadline:
    pass  # spin, holding the GIL whenever Gloo's thread lets go of it
print("freed by Gloo's thread" if freeing else "not freed by Gloo's thread", flush=True)
