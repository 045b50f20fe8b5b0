"""Python stubs for proto/pdserve/v1/*.proto, generated at build time (never edited by hand).

`make install` (or `make proto`) and `setup.py build_py` run grpc_tools.protoc with the virtual
import path ``services/proto_gen=proto``, so the generated modules import each other as
``services.proto_gen.pdserve.v1.*``.
"""
