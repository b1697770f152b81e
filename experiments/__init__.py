"""Runnable experiments, one module each, run from the repository root as
``python -m experiments.NAME``:

========================  ===============================================================
``compare``               the main job: methods x link rates x workloads, tables and plots
``convergence``           the convergence study: long runs of each method's recommended recipe
``scaling``               the scaling study: the cost model's bytes and times against the number of ranks
``train``                 the DDP training runner (one method, N ranks over Gloo or NCCL)
``horovod_train``         the same under ``horovodrun``, with gradcomp's Horovod optimizer
``step_times``            every method's step time on every link, interleaved in one launch of the ranks
``horovod_step_times``    the same under ``horovodrun``, one launch per method, link and round
``time_to_accuracy``      the study's evaluations x those step times: time to dense's quality
``netem``                 link emulation: a tbf-shaped loopback in a private network namespace
``plots``                 re-draws a comparison's plots from its ``summary.json``
``bench_kernels``         every kernel op x backend x size, against the memory-bandwidth floor
``gpu_selfcheck``         every CUDA kernel against the torch reference on a real GPU
========================  ===============================================================

Shared pieces: ``catalog`` (the methods, record fields and log reading), ``workloads`` (the
models and data, none of which needs a download), ``runner`` (the one per-rank training loop),
``launch`` (the one launcher of ranks) and ``fingerprint`` (which code made a study's log). This package is
not installed; it imports gradcomp as installed (``pip install -e .``).
"""
