"""Simulated network links, to study communication costs on a single machine.

On one machine, ranks talk through shared memory at memcpy speed, so a ring and a tree look
alike.  The alpha-beta (latency-bandwidth) model of a real link, t(n) = alpha + n / beta
(Hockney 1994; used throughout Thakur, Rabenseifner & Gropp 2005), makes the differences
visible: every message sleeps ``latency_us`` microseconds plus ``bytes / (gbps * 1e9 / 8)``
seconds before it is sent.

Off by default.  Turn it on with the environment variables ``MINIDIST_LINK_LATENCY_US`` and
``MINIDIST_LINK_GBPS`` (read once, at import) or from code with :func:`set_link_model`.
"""

from __future__ import annotations

import os
import time

_latency_s = 0.0
_bytes_per_s = 0.0  # 0 = infinite bandwidth
enabled = False


def set_link_model(latency_us: float = 0.0, gbps: float | None = None) -> None:
    """Make every message cost ``latency_us`` µs plus its size at ``gbps`` gigabits/s.

    ``set_link_model()`` (no arguments) turns the simulation off again.
    """
    global _latency_s, _bytes_per_s, enabled
    try:
        latency_us = float(latency_us)
        gbps = None if gbps is None else float(gbps)
    except (TypeError, ValueError):
        raise ValueError(f"set_link_model: latency_us={latency_us!r}, gbps={gbps!r} must be numbers") from None
    if latency_us < 0 or latency_us != latency_us:
        raise ValueError(f"set_link_model: latency_us={latency_us!r} must be >= 0")
    if gbps is not None and not gbps > 0:
        raise ValueError(f"set_link_model: gbps={gbps!r} must be > 0 (or None for unlimited)")
    _latency_s = latency_us * 1e-6
    _bytes_per_s = 0.0 if gbps is None else gbps * 1e9 / 8
    enabled = _latency_s > 0 or _bytes_per_s > 0


def link_model() -> dict:
    """The current model: ``{"latency_us": ..., "gbps": ... or None}``."""
    return {"latency_us": _latency_s * 1e6, "gbps": _bytes_per_s * 8 / 1e9 if _bytes_per_s else None}


def delay(nbytes: int) -> None:
    """Sleep as long as sending ``nbytes`` over the simulated link would take."""
    t = _latency_s + (nbytes / _bytes_per_s if _bytes_per_s else 0.0)
    if t > 0:
        time.sleep(t)


def _from_environment() -> None:
    lat = os.environ.get("MINIDIST_LINK_LATENCY_US", "").strip()
    bw = os.environ.get("MINIDIST_LINK_GBPS", "").strip()
    if not (lat or bw):
        return
    try:
        set_link_model(float(lat) if lat else 0.0, float(bw) if bw else None)
    except ValueError:
        raise ValueError(f"bad simulated link: MINIDIST_LINK_LATENCY_US={lat!r}, "
                         f"MINIDIST_LINK_GBPS={bw!r} (expected numbers >= 0 and > 0)") from None


_from_environment()
