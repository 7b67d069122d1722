"""effattn: attention surgery on pretrained LLMs."""

import os

# MKL may otherwise run a product on fewer threads than torch asks for when the machine is busy, and a
# different split rounds differently: a conversion or a resumed fine-tune would then depend on the
# load. Set before torch loads MKL; a user's own MKL_DYNAMIC wins.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

__version__ = "0.1.0"


def _keep_freed_memory() -> None:
    """glibc malloc: serve allocations up to 32 MB from the heap and never trim it (EFFATTN_KEEP_HEAP=0: leave
    malloc as it is).

    Long-sequence layers allocate and free tens of MB per chunk. With glibc's adaptive defaults some of
    it goes back to the system at every free and is faulted in again, page by page, at the next chunk,
    depending on how the heap happens to lie: measured on 2 cores, one linear-attention layer at 32K
    tokens took 0.59 s to 0.93 s from process to process (0.3M to 1.2M minor page faults); kept, 0.55-0.59
    s in every process (0.2M). Intel's PyTorch tuning guide swaps in another allocator (jemalloc or
    tcmalloc) to the same end. The cost: a process's resident memory stays at its peak once reached."""
    if os.environ.get("EFFATTN_KEEP_HEAP", "1") == "0":
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): its own allocator stays as it is
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's maximum on 64-bit systems
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


_keep_freed_memory()


def _register_models() -> None:
    """`AutoModelForCausalLM.from_pretrained` loads effattn's converted models after `import effattn`:
    every conversion's model class (models.py) is registered."""
    try:
        from .models import register_all
    except ImportError:  # transformers missing: the rest of effattn reports it where it is needed
        return
    register_all()


_register_models()
