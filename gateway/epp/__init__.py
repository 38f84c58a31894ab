"""`kvgate epp`: kvgate as a Gateway API Inference Extension endpoint picker behind Envoy.

Envoy asks over its ext_proc gRPC stream which engine serves each request; kvgate answers with
the same Gateway and Conductor as `kvgate serve` (gateway/runtime.py) and keeps the books from
what it sees of the answer. Modules: ``protocol`` (the ext_proc messages, pure), ``picker``
(one request's pick and books), ``server`` (the gRPC server, health, metrics, signals),
``cli`` (the subcommand). Imported only by `kvgate epp`: grpc is an optional dependency.
"""
