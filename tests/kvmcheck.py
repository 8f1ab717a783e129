"""scripts/check-kvm as the tests run it: where it is, and how long four boots may take."""

from __future__ import annotations

from guestvm import ROOT

CHECK = ROOT / "scripts" / "check-kvm"


RUN_TIMEOUT = 300.0  # four boots of at most --timeout each, on a loaded 2-core host
