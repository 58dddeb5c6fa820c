"""A Triton kernel compiled for sm_90 (H100/H200) without a GPU, and its register and stack use: Triton ships ptxas
and cuobjdump, so only triton is needed. The kernel tests check that no kernel spills registers at the shapes served."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any


def compile_sm90(kernel: Any, signature: dict[str, str], constexprs: dict, attrs: dict, warps: int,
                 stages: int | None = None) -> tuple[Any, int, int]:
    """(the compiled kernel, registers per thread, stack bytes per thread) of `kernel` with this signature."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options: dict[str, int] = {"num_warps": warps}
    if stages is not None:
        options["num_stages"] = stages
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = Path(compiled.metadata.name + ".cubin")
    try:
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    finally:
        cubin.unlink(missing_ok=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert found, usage
    return compiled, int(found[1]), int(found[2])
