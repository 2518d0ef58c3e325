"""Triton kernels of the ``TRITON`` attention backend (runnable under ``TRITON_INTERPRET=1``)."""
