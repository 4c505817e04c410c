"""The transport's floor under the all-reduce: the butterfly's traffic with no averaging at all.

The all-reduce of ``allreduce_bench.py`` moves, per learner, (N − 1)/N of its payload out to its
groupmates in parts and as much back (the averaged parts). This benchmark moves exactly that traffic,
as the same protobuf messages (``averaging_pb2.AveragingData`` carrying ``part_size`` bytes each), and
nothing else: every peer streams its parts to each groupmate, which echoes each part back at once
(where a reducer would first wait for all its senders and add them). Two transports, N processes each
on 127.0.0.1, side by side:

* **p2pd**: one ``hivemind.P2P`` per process (its own p2pd, TLS over TCP, yamux streams), parts sent
  with ``iterate_protobuf_handler`` to a ``add_protobuf_handler(stream_input=True, stream_output=True)``
  echo handler: the path the all-reduce's parts take (Python → unix socket → p2pd → TCP → p2pd → unix
  socket → Python, and back).
* **tcp**: plain asyncio TCP connections between the same processes, the same messages framed the
  same way (a marker byte, an 8-byte length, the serialized protobuf): Python's share of that path
  without p2pd.

Each round starts at a barrier; its time is the slowest peer's, from the barrier until its last echo
came back. One warm-up round, then ``--rounds`` timed ones; medians. The all-reduce itself
(``allreduce_bench.py``) and gloo's (the same script) are the figures to put beside these: the gap
between the all-reduce and **p2pd** is the averaging (matchmaking not included in either), the gap
between **p2pd** and **tcp** is the daemon's, and **tcp** against gloo is Python's.

    python benchmarks/transport_floor.py --size large --learners 4 --rounds 5 --part-sizes 524288,2097152 \
        --json benchmarks/results/transport_floor_<date>_<commit>.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

SIZES = {"medium": 875_264, "large": 4_935_680}  # fp32 values: allreduce_bench.py's models
LOOPBACK = "127.0.0.1"
WARMUP_ROUNDS = 1


def _message(nbytes: int):
    from hivemind.proto import averaging_pb2, runtime_pb2

    return averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=os.urandom(nbytes), size=[nbytes // 4],
                                                                      dtype="float32"))


def _parts(payload: int, n: int, part_size: int) -> list[int]:
    """The byte sizes of the parts one peer sends to one groupmate: its 1/N shard in parts of ``part_size``."""
    shard = payload // n
    return [min(part_size, shard - start) for start in range(0, shard, part_size)]


async def _timed_rounds(exchange, groupmates: list, expected: int, rounds: int, barrier) -> list[float]:
    """Warm-up and timed rounds of ``exchange`` with every groupmate at once, each started at the barrier;
    each round's seconds (after the warm-up), checking that every groupmate echoed ``expected`` bytes."""
    loop = asyncio.get_running_loop()
    times = []
    for _ in range(WARMUP_ROUNDS + rounds):
        await loop.run_in_executor(None, barrier.wait)
        t0 = time.perf_counter()
        got = await asyncio.gather(*(exchange(peer) for peer in groupmates))
        times.append(time.perf_counter() - t0)
        assert all(g == expected for g in got), got
    await loop.run_in_executor(None, barrier.wait)  # nobody leaves while others still send
    return times[WARMUP_ROUNDS:]


async def _p2pd_peer(i: int, n: int, sizes: list[int], rounds: int, conn, barrier) -> list[float]:
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import averaging_pb2
    from hivemind.utils.multiaddr import Multiaddr

    p2p = await P2P.create(host_maddrs=[f"/ip4/{LOOPBACK}/tcp/0"])

    async def echo(requests, _context):
        async for message in requests:
            yield message

    await p2p.add_protobuf_handler("echo", echo, averaging_pb2.AveragingData, stream_input=True, stream_output=True)
    conn.send((p2p.peer_id.to_bytes(), [str(m) for m in await p2p.get_visible_maddrs()]))
    everyone = conn.recv()
    others = []
    for j, (pid, maddrs) in enumerate(everyone):
        if j != i:
            peer = PeerID(pid)
            await p2p._client.connect(peer, [Multiaddr(m.split("/p2p/")[0]) for m in maddrs])
            others.append(peer)
    messages = [_message(s) for s in sizes]

    async def exchange(peer) -> int:
        async def requests():
            for m in messages:
                yield m

        got = 0
        async for reply in await p2p.iterate_protobuf_handler(peer, "echo", requests(), averaging_pb2.AveragingData):
            got += len(reply.tensor_part.buffer)
        return got

    try:
        return await _timed_rounds(exchange, others, sum(sizes), rounds, barrier)
    finally:
        await p2p.shutdown()


async def _tcp_peer(i: int, n: int, sizes: list[int], rounds: int, conn, barrier) -> list[float]:
    from hivemind.p2p import P2P
    from hivemind.proto import averaging_pb2

    async def serve(reader, writer):
        try:
            while True:
                try:
                    message, _ = await P2P.receive_protobuf(averaging_pb2.AveragingData, reader)
                except asyncio.IncompleteReadError:
                    return
                await P2P.send_protobuf(message, writer)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(serve, LOOPBACK, 0)
    conn.send(server.sockets[0].getsockname()[1])
    ports = [p for j, p in enumerate(conn.recv()) if j != i]
    messages = [_message(s) for s in sizes]

    async def exchange(port: int) -> int:
        reader, writer = await asyncio.open_connection(LOOPBACK, port)

        async def send():
            for m in messages:
                await P2P.send_protobuf(m, writer)

        sending = asyncio.create_task(send())
        got = 0
        for _ in messages:
            reply, _ = await P2P.receive_protobuf(averaging_pb2.AveragingData, reader)
            got += len(reply.tensor_part.buffer)
        await sending
        writer.close()
        await writer.wait_closed()
        return got

    try:
        return await _timed_rounds(exchange, ports, sum(sizes), rounds, barrier)
    finally:
        server.close()
        await server.wait_closed()


def _peer(transport: str, i: int, n: int, sizes: list[int], rounds: int, conn, barrier, out) -> None:
    run = _p2pd_peer if transport == "p2pd" else _tcp_peer
    out.put((i, asyncio.run(run(i, n, sizes, rounds, conn, barrier))))


def measure(transport: str, n: int, payload: int, part_size: int, rounds: int, timeout: float = 300) -> dict:
    """Run N peers of one transport; per round, the slowest peer's seconds."""
    ctx = mp.get_context("spawn")
    sizes = _parts(payload, n, part_size)
    barrier, out = ctx.Barrier(n), ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(n)]
    procs = [ctx.Process(target=_peer, args=(transport, i, n, sizes, rounds, pipes[i][1], barrier, out), daemon=True)
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        addresses = []
        for i in range(n):
            if not pipes[i][0].poll(60):
                raise RuntimeError(f"{transport} peer {i} did not start within 60 s")
            addresses.append(pipes[i][0].recv())
        for parent, _ in pipes:
            parent.send(addresses)
        results: dict[int, list[float]] = {}
        deadline = time.monotonic() + timeout
        while len(results) < n:
            try:
                i, times = out.get(timeout=1.0)
                results[i] = times
            except queue.Empty:
                failed = [j for j, p in enumerate(procs) if p.exitcode not in (None, 0) and j not in results]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"{transport} peers {failed or 'all'} failed or timed out") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    per_round = [max(results[i][r] for i in range(n)) for r in range(rounds)]
    sent = 2 * (n - 1) * sum(sizes)  # parts out and echoes back, payload bytes per peer
    return {"transport": transport, "learners": n, "payload_bytes": payload, "part_size": part_size,
            "parts_per_stream": len(sizes), "payload_mb_sent_per_peer": round(sent / 1e6, 2),
            "round_s": per_round, "round_s_median": statistics.median(per_round),
            "mb_per_s_per_peer": round(sent / 1e6 / statistics.median(per_round), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="large")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--part-sizes", default="524288", help="comma list of part sizes in bytes (hivemind's: 524288)")
    p.add_argument("--transports", default="p2pd,tcp")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    payload = SIZES[a.size] * 4
    rows = []
    for part_size in [int(x) for x in a.part_sizes.split(",")]:
        for transport in a.transports.split(","):
            row = measure(transport, a.learners, payload, part_size, a.rounds)
            print(json.dumps({k: v for k, v in row.items() if k != "round_s"}), flush=True)
            rows.append(row)
    print("\n| transport | part size | parts per stream | payload MB sent per peer | round s (median) | "
          "MB/s per peer |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['transport']} | {r['part_size']:,} | {r['parts_per_stream']} | {r['payload_mb_sent_per_peer']} "
              f"| {r['round_s_median']:.3f} | {r['mb_per_s_per_peer']} |")
    if a.json:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
        a.json.write_text(json.dumps({"meta": {"command": " ".join(["python", *sys.argv]),
                                               "date": datetime.now(UTC).isoformat(timespec="seconds"),
                                               "p2p_diloco_revision": rev, "cpus": os.cpu_count(),
                                               "platform": platform.platform(), "size": a.size},
                                      "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
