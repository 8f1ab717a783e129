"""How a guest OS tells its processes apart: the Emerald metadata page, else CR3."""
