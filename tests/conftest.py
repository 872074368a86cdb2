"""Test setup: 8 simulated CPU devices, configured before JAX initialises."""
import os

# Must happen before the first `import jax` anywhere in the test process.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8, jax.devices()
