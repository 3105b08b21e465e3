"""Crucible: a fault-tolerant trainer of pipelined, data-parallel replicas over gRPC."""

__version__ = "0.1.0"

# Bumped whenever the wire contract in proto/crucible.proto changes meaning.
PROTOCOL_VERSION = 7    # 2: HELLOs signed per registration (identity), outer rounds can be abandoned;
                        # 3: heartbeats carry the registration's secret;
                        # 4: so do reports, outer contributions and shard reports;
                        # 5: and rejoins (RegisterRequest.secret);
                        # 6: stage 0 registers with its corpus (RegisterRequest.corpus);
                        # 7: outer rounds are numbered from RegisterReply.outer_origin
                        # (tests/test_proto.py pins each version's messages: a change fails it until bumped)
