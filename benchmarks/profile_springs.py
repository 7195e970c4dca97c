"""One forward and one fwd+bwd of the 16.8M-spring force kernel, for Nsight Compute (docs/profiles.md):

    ncu --clock-control none --replay-mode application -k regex:spring_forces -c 3 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --metrics lts__t_requests_op_red.sum,lts__t_sectors_op_red.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        python -m benchmarks.profile_springs [rows|kinds]

The spring order (see models.grid_springs) is the optional argument, default ``rows``; docs/profiles.md's
Nsight Compute numbers are for ``kinds``.

(Kernel replay saves and restores the 1.5 GB of device memory for each of ncu's 11 passes, which took
over 3 minutes on an H200; application replay reruns this short script instead.)
"""

import sys

import jax
import jax.numpy as jnp

from warpnn.kernels import cloth

from .models import grid_springs

n = 2048
springs = grid_springs(n, sys.argv[1] if len(sys.argv) > 1 else "rows")
m = springs.shape[0]
gx, gy = jnp.meshgrid(jnp.arange(n, dtype=jnp.float32), jnp.arange(n, dtype=jnp.float32), indexing="ij")
x = jnp.stack([gx.ravel(), jnp.zeros(n * n), gy.ravel()], 1) * 0.01
v = jnp.zeros_like(x)
k, d, r = jnp.full((m,), 100.0), jnp.full((m,), 0.1), jnp.full((m,), 0.01)
fwd = jax.jit(lambda x, v, k, d, r: cloth.spring_forces(x, v, springs, k, d, r))
grad = jax.jit(jax.grad(lambda x, v, k, d, r: jnp.sum(cloth.spring_forces(x, v, springs, k, d, r) ** 2), argnums=(0, 2)))
jax.block_until_ready(fwd(x, v, k, d, r))
jax.block_until_ready(grad(x, v, k, d, r))
