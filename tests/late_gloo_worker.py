"""One rank of a two-rank job whose last collective is freed by Gloo's thread as the script ends.

``python late_gloo_worker.py PORT RANK MODE`` (MODE ``bare``, ``held`` or ``shared``). Forces the teardown
order of the measured exit abort (``gradcomp.inflight``): rank 0 starts an allgather of large
Python-created tensors and drops every Python reference to them and to the work, so Gloo's
thread is their last owner. Rank 1 joins 2 s later; Gloo's thread on rank 0 then frees the tensors,
taking the GIL for each Python object and releasing it while the 256 MB buffer is freed. A weak
reference tells the main thread that the first one is being freed, and the script ends at once:
the main thread takes the GIL and begins finalizing while Gloo's thread is still inside the
tensor's destructor, which then cannot take the GIL back (``pthread_exit``, ``std::terminate``).
With MODE ``held`` the tensors are held by ``gradcomp.inflight`` first, as gradcomp holds every
tensor it hands to a collective: Gloo's thread never frees a Python object, and the exit waits.
MODE ``shared`` holds tensors that have two more C++ owners (DDP's reducer and the hook's GradBucket
own a bucket buffer) which let go while Gloo still holds them: counting the tensor's own owners took
that for Gloo's release and let go too early (3 of 3 jobs aborted); holding an alias that only the
collective and ``gradcomp.inflight`` own does not (3 of 3 exited 0).
MODE ``foreign`` hands Gloo the bare tensors, as another library's collective does, in a process that
uses gradcomp: the exit waits for Gloo's worker threads to be idle
(``gradcomp.inflight.wait_for_idle_gloo_threads``).
MODE ``value`` forces the same order on the tensors a callback's ``value()`` makes Python objects of
(Gloo's allgather into one tensor gives back views of it that only the work owns; the work is
destroyed after the callback): bare, the abort; ``kept``, with ``gradcomp.inflight.keep`` as the DDP
hook does, the main thread frees them.
"""
import os
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # as gradcomp's DDP hook
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
    if mode in ("value", "kept"):
        gather_flat(torch.empty(2 * ELEMENTS), tensor)
    else:
        dist.all_gather(outputs, tensor)
    sys.exit(0)
freeing = []  # whether the thread that freed the caller's first output was the main thread
if mode in ("value", "kept"):
    from gradcomp import inflight

    def read(fut):  # as the DDP hook's callback reads the gather, on Gloo's thread
        value = fut.value()
        weakref.finalize(value[0], lambda: freeing.append(threading.current_thread() is threading.main_thread()))
        if mode == "kept":
            inflight.keep(value)
        return None

    received, sent = inflight.hold(torch.empty(2 * ELEMENTS), tensor)
    child = gather_flat(received, sent, async_op=True).get_future().then(read)
    del received, sent, tensor, outputs  # the work's views of the output are now its storage's only owners
    inflight.pending()  # prunes the aliases (the work holds views, not them)
    group = dist.group.WORLD
    dist.destroy_process_group()
    deadline = time.time() + 30.0
    while not freeing and time.time() < deadline:
        if mode == "kept" and child.done():
            inflight.pending()  # frees what the work has let go of, here
    print({(): "not freed", (True,): "freed by the main thread", (False,): "freed by Gloo's thread"}[tuple(freeing)],
          flush=True)
    sys.exit(0)
weakref.finalize(outputs[0], lambda: freeing.append(threading.current_thread() is threading.main_thread()))
# Two more C++ owners of each tensor, as DDP's reducer and the hook's GradBucket own a bucket buffer.
reducer = torch._C.ScriptList([tensor, *outputs] * 2) if mode == "shared" else None
if mode in ("held", "shared"):
    from gradcomp import inflight

    tensor, *outputs = inflight.hold(tensor, *outputs)  # what to hand to Gloo
if mode == "foreign":  # gradcomp in use (its exit hook installed), the collective another library's
    from gradcomp import inflight

    inflight.hold(torch.zeros(1))
work = dist.all_gather(outputs, tensor, async_op=True)
del outputs, tensor, work  # Gloo's thread is now the last owner (bare) or not (held)
if mode == "shared":
    del reducer  # the model is freed while Gloo still holds its buckets...
    inflight.pending()  # ...and the next collective's hold prunes what was let go of
# As a script that used DDP leaves it: the group destroyed, an object still referencing it, so
# CPython frees it while finalizing and joins Gloo's threads there.
group = dist.group.WORLD
dist.destroy_process_group()
deadline = time.time() + 30.0
while not freeing and time.time() < deadline:
    pass  # spin, holding the GIL whenever Gloo's thread lets go of it
outcome = {(): "not freed", (True,): "freed by the main thread", (False,): "freed by Gloo's thread"}
print(outcome[tuple(freeing)], flush=True)
