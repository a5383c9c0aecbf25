"""ringctx's CPU kernels (csrc/cpu_*.c), built for this CPU's vector ISA, with PyTorch as the fallback.

Above the core modules and below attention/ and model/, which import it:

    cpu_features   what this CPU is: its flags, its model name, whether PyTorch computes bf16 natively
    paths          where the kernel sources are (the C ones here, the CUDA ones in attention/cuda_ext.py)
    abi            the C structs and limits the library shares with Python, checked when it loads
    build          the variants, their build with the system C compiler, the cached library, loading
    selection      which kernel runs: every rule and row threshold that picks one, asked by the
                   layer-by-layer path and the fused steps alike
    cpu            the thin wrappers: tensors in, one library call, tensors out (None: not applicable)
    report         what `ringctx info` says of them

Import the module you need (`from ringctx.kernels import cpu, selection`); this package re-exports
nothing, so that each name has one home.
"""
