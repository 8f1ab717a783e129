"""pprof's own profile.proto (github.com/google/pprof, proto/profile.proto, kept as it is) and
the code protoc generates from it for the ``protobuf`` runtime: ``profile_pb2.py`` and its
types for mypy, ``profile_pb2.pyi``. Generated files are committed, not written by hand:
``scripts/gen-pprof-proto`` makes them again with the pinned generator.
"""
