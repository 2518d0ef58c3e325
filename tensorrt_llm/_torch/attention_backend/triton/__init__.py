"""Triton kernels of the ``TRITON`` attention backend (runnable under ``TRITON_INTERPRET=1``).

Layers, each a small module:

    kv_write_kernel.py, attention_kernel.py  the dense ``@triton.jit`` kernels
    launch.py                                 their tile sizes, grids, strides
    ops.py                                    the public dense ops: ``write_kv_pages``,
                                              ``paged_attention``, ``choose_num_splits``
    addressing.py, step.py                    what the dense ops read: ``PagedKV`` (pages, block
                                              table, ``PageAddressing``) and ``StepBatch``
    backend.py                                ``TritonAttentionBackend``

MiniMax-M3's sparse attention keeps its Triton kernels with its family
(``sparse/minimax_m3/triton_msa*.py``). On a machine without a GPU the kernels run under
``TRITON_INTERPRET=1`` (set before the kernel modules are imported); this package imports nothing
at package level, so selecting another backend never imports Triton.
"""
