"""A TCP port for a server the test starts in another process.

A port from bind(("", 0)) comes from the kernel's ephemeral range, which the kernel also hands out to every
outgoing connection: between our check and the server's bind another process (Ray's workers, a gRPC client) can
take it, and jax.distributed's coordinator then dies binding [::]:port. So the port is drawn below the
ephemeral range and checked free on IPv4 and IPv6 both, as the coordinator binds the dual-stack wildcard.
"""
import random
import socket


def _ephemeral_low() -> int:
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return 32768


def _bindable(port: int) -> bool:
  for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, port))
    except OSError:
      if family == socket.AF_INET6 and not socket.has_ipv6:
        continue
      return False
  return True


def free_port() -> int:
  """A port in [20000, ephemeral low) that nothing listens on now, on 0.0.0.0 or [::]."""
  # Ray's worker ports are 10002-19999 by default; 20000 up stays clear of them.
  low, high = 20000, max(_ephemeral_low(), 20100)
  rng = random.Random()
  for _ in range(200):
    port = rng.randrange(low, high)
    if _bindable(port):
      return port
  raise RuntimeError(f"no free TCP port in [{low}, {high})")
