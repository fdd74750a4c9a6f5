"""A drafter that speaks splitspec.v1.Drafter honestly but answers Propose with garbage.

Negotiate and Attach follow the contract (the shared token, the handshake order, a
poolless "ngram" kind so nothing is mapped); every Propose answers each sequence that
asks for drafts with the next kind of garbage, in turn:

  oov        ids outside the vocabulary (>= vocab_size, or negative)
  too_long   more tokens than the sequence asked for
  wrong_seq  a draft for a sequence id the target never sent
  duplicate  two drafts for the same sequence
  random     valid ids in range, at random (a bad drafter, not a broken one)

The target must treat all but `random` as invalid (its invalid-draft counter counts
each, and both drafts of a duplicate), verify `random` drafts like any others, and never
fail a request or emit a wrong token. `--stats-file` gets the running counts as JSON.

    python -m tests.garbage_drafter --port 0 [--stats-file PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.auth import load_internal_token, token_matches
from splitspec.v1 import drafter_pb2 as dpb
from splitspec.v1 import drafter_pb2_grpc as dpb_grpc
from splitspec.v1 import kv_layout_pb2 as kv_pb

KINDS = ("oov", "too_long", "wrong_seq", "duplicate", "random")
K = 4
log = logging.getLogger("garbage_drafter")


class GarbageDrafter(dpb_grpc.DrafterServicer):
    def __init__(self, token: str, stats_file: Path | None) -> None:
        self._token = token
        self._stats_file = stats_file
        self._lock = threading.Lock()
        self._rng = random.Random(0)
        self._vocab = 0
        self._negotiated = ""
        self._attached: tuple[str, int] | None = None
        self._turn = 0
        self.sent = {kind: 0 for kind in KINDS}
        self.sent["invalid_drafts"] = 0  # drafts the target must discard

    def _check_token(self, context) -> None:
        if not token_matches(context.invocation_metadata(), self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")

    def Negotiate(self, request, context):
        self._check_token(context)
        with self._lock:
            self._vocab, self._negotiated, self._attached = request.target.vocab_size, request.target_id, None
        return dpb.NegotiateResponse(kind=dpb.DRAFTER_KIND_NGRAM, supported_orders=[kv_pb.PAGE_ORDER_NHD,
                                                                                     kv_pb.PAGE_ORDER_HND],
                                     num_speculative_tokens=K, model_id="garbage")

    def Attach(self, request, context):
        self._check_token(context)
        layout = request.layout
        with self._lock:
            if layout.target_id != self._negotiated:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Attach before Negotiate")
            self._attached = (layout.target_id, layout.epoch)
        return dpb.AttachResponse(target_id=layout.target_id, epoch=layout.epoch, mapped_bytes=0)

    def Propose(self, request, context):
        self._check_token(context)
        with self._lock:
            if self._attached != (request.target_id, request.epoch):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              "KV cache layout has not been resolved yet: Negotiate and Attach first")
            drafts = []
            for update in request.sequences:
                if update.num_speculative_tokens:
                    drafts.extend(self._garbage(update.seq_id, update.num_speculative_tokens))
            self._save_stats()
        return dpb.ProposeResponse(drafts=drafts)

    def _garbage(self, seq_id: int, k: int) -> list[dpb.Draft]:
        kind = KINDS[self._turn % len(KINDS)]
        self._turn += 1
        self.sent[kind] += 1
        vocab, rng = self._vocab, self._rng
        valid = [rng.randrange(vocab) for _ in range(k)]
        if kind == "oov":
            bad = [vocab + rng.randrange(1000), -1 - rng.randrange(1000)][rng.randrange(2)]
            tokens = valid[: k - 1] + [bad]
        elif kind == "too_long":
            tokens = valid + [rng.randrange(vocab) for _ in range(3)]
        elif kind == "wrong_seq":
            return self._invalid([dpb.Draft(seq_id=seq_id + 10**9, token_ids=valid)])
        elif kind == "duplicate":
            return self._invalid([dpb.Draft(seq_id=seq_id, token_ids=valid), dpb.Draft(seq_id=seq_id, token_ids=valid)])
        else:
            return [dpb.Draft(seq_id=seq_id, token_ids=valid)]
        return self._invalid([dpb.Draft(seq_id=seq_id, token_ids=tokens)])

    def _invalid(self, drafts: list[dpb.Draft]) -> list[dpb.Draft]:
        self.sent["invalid_drafts"] += len(drafts)
        return drafts

    def _save_stats(self) -> None:
        if self._stats_file is not None:
            tmp = self._stats_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.sent))
            tmp.replace(self._stats_file)

    def Release(self, request, context):
        self._check_token(context)
        return dpb.ReleaseResponse()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--stats-file", type=Path, default=None)
    parser.add_argument("--metrics-port", type=int, default=0, help="accepted for tests/procs.Service; no metrics")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    dpb_grpc.add_DrafterServicer_to_server(GarbageDrafter(load_internal_token(), args.stats_file), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("garbage drafter listening on 127.0.0.1:%d", port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(1).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
