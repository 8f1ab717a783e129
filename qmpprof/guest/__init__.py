"""The guest OSes qmpprof reads: ``base`` is the seam (``GuestOs``, ``Guest``), ``registry``
chooses one for a run. The registry is a module of its own, not this package's, so that a guest
OS kept outside this package (Linux, in ``qmpprof.linux``) can import ``base`` without the
registry importing it back half-loaded."""
