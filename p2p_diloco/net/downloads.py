"""Serving and fetching the global state between averagers: the download path of :class:`StateDownloads`.

hivemind's averager serves its whole state (``rpc_download_state``) and downloads from the peer of highest
priority. :class:`StateDownloads` is mixed into :class:`.averager_process.OuterGradientAverager` and runs in
hivemind's averager process, as it does:

- serving single fragments (``rpc_download_fragments``) besides the whole state;
- downloading from one named peer (the learner chooses whom, from the progress records) or from the peers of
  highest signed priority (:mod:`p2p_diloco.trust.signed_matchmaking`), at most :data:`_MAX_PEERS_TRIED` of them;
- every download capped at the bytes the state can take (:meth:`StateDownloads.download_cap`), counted as it
  arrives (a failed download counts too), and a stream the link cut is a ConnectionError (:func:`whole_tensor`),
  not a malformed state.

The learner verifies what arrives (certificates, hashes; :mod:`p2p_diloco.learner.catch_up`); nothing here trusts it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads typing.AsyncIterator

import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from p2p_diloco.core.state_layout import select_fragments
from p2p_diloco.trust.signed_matchmaking import declared, download_key

logger = get_logger(__name__)

MAX_METADATA_BYTES = 8 * 1024 * 1024  # served metadata: per fragment, history, contributors, certificates
_MAX_PEERS_TRIED = 8  # a download from "any peer" tries at most this many, highest priority first


class StateDownloads:
    """The download path of an averager (module docstring); a mixin of hivemind's ``DecentralizedAverager``, whose
    attributes it uses (``_p2p``, ``prefix``, ``serializer``, ``dht``, ``peer_id``, ``state_compression``,
    ``allow_state_sharing``, ``next_chunk_timeout``, ``_outer_pipe``, ``_matchmaking``) with the averager's own:
    ``_fragments`` (tensor indices of each fragment), ``_served_bytes`` (fp32 bytes of each fragment's Θ and
    momentum), ``_owner`` (our signed subkey) and ``_state_provider``."""

    # The averager's own.
    _fragments: list[tuple[int, ...]]
    _served_bytes: list[int]
    _owner: bytes
    _state_provider: Any
    # hivemind's DecentralizedAverager's (untyped).
    _p2p: Any
    _outer_pipe: Any
    _matchmaking: Any
    prefix: str
    serializer: Any
    state_compression: Any
    allow_state_sharing: bool
    next_chunk_timeout: float | None
    dht: Any
    peer_id: Any
    get_stub: Any
    _get_current_state_from_host_process: Any

    def load_state_from_peer(self, peer: str, timeout: float, fragments: Sequence[int] | None = None):
        """Download the state of one given peer: an MPFuture of ((metadata, tensors) or None, bytes received).

        ``fragments``: only these fragments' tensors (parameters then momentum of each, in order);
        None: the whole state.
        """
        future = MPFuture()
        wanted = None if fragments is None else [int(f) for f in fragments]
        self._outer_pipe.send(("_load_state_from_peer", [],
                               dict(peer=peer, timeout=timeout, future=future, fragments=wanted)))
        return future

    async def rpc_download_fragments(
        self, request: averaging_pb2.AveragingData, _context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Stream the served metadata and the tensors of the fragments listed in ``request.group_id``.

        hivemind has no download request with a free field, so this reuses ``AveragingData``: its
        ``group_id`` bytes carry the msgpack list of fragment indices wanted.
        """
        if not self.allow_state_sharing:
            return
        try:
            wanted = sorted({int(f) for f in self.serializer.loads(request.group_id)})
            if not wanted or not all(0 <= f < len(self._fragments) for f in wanted):
                raise ValueError(f"fragments {wanted} out of range")
        except Exception as e:  # noqa: BLE001 - a malformed request is refused, not fatal
            logger.warning(f"refused a fragment download request: {e!r}")
            return
        metadata, tensors, _ = await self._get_current_state_from_host_process()
        selected = select_fragments(tensors, [len(indices) for indices in self._fragments], wanted)
        for i, tensor in enumerate(selected):
            info = CompressionInfo.from_tensor(tensor, key=i)
            for part in split_for_streaming(self.state_compression.compress(tensor, info, allow_inplace=False)):
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata or b"")
                metadata = None

    async def _load_state_from_peer(
        self, peer: str, timeout: float, future: MPFuture, fragments: list[int] | None = None
    ) -> None:
        received = [0]  # what came in counts even when the download fails
        try:
            future.set_result((await self._download(PeerID.from_base58(peer), timeout, fragments, received),
                               received[0]))
        except Exception as e:  # noqa: BLE001 - any failure: the caller tries another peer
            logger.warning(f"download from {peer} failed: {e!r}")
            if not future.done():
                future.set_result((None, received[0]))

    async def _load_state_from_peers(self, future: MPFuture, timeout: float | None = None) -> None:
        """hivemind's "download from the peer of highest priority", through :meth:`_download` (capped); the
        future's result is ((metadata, tensors) or None, bytes received from every peer tried)."""
        received = [0]
        try:
            found = self.dht.get(download_key(self._matchmaking.group_key_manager.prefix), latest=True)
            priority = {}
            for peer, info in declared(found.value if found is not None else None, self._owner,
                                       getattr(self.dht, "admission", None)):
                value = getattr(info, "value", None)
                if isinstance(value, float | int) and not isinstance(value, bool):
                    priority[peer] = (float(value), random.random())
            for peer in sorted(priority, key=priority.__getitem__, reverse=True)[:_MAX_PEERS_TRIED]:
                if peer == self.peer_id:
                    continue
                try:
                    loaded = await self._download(peer, timeout or self.next_chunk_timeout or 15.0, None, received)
                except Exception as e:  # noqa: BLE001 - try the next peer
                    logger.warning(f"download from {peer} failed: {e!r}")
                    continue
                if loaded is not None:
                    future.set_result((loaded, received[0]))
                    return
        finally:
            if not future.done():
                future.set_result((None, received[0]))

    async def _download(self, peer: PeerID, timeout: float, fragments: list[int] | None,
                        counted: list[int]) -> tuple[Any, list] | None:
        """(metadata, tensors) that ``peer`` serves (only ``fragments``' tensors if given), or None if it
        serves nothing. A stream longer than :meth:`download_cap` is cut (ValueError). ``counted[0]`` grows by
        every message's size as it arrives (``ByteSize``, as the all-reduce counts), so a failed download counts too."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        if fragments is None:
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        else:
            request = averaging_pb2.AveragingData(group_id=self.serializer.dumps(fragments))
            stream = await stub.rpc_download_fragments(request)
        metadata: Any = None
        tensors: list[torch.Tensor] = []
        parts: list[Any] = []
        received, cap = 0, self.download_cap(fragments)
        async for message in aiter_with_timeout(stream, timeout=timeout):
            counted[0] += message.ByteSize()
            received += len(message.tensor_part.buffer) + len(message.metadata)
            if received > cap:
                raise ValueError(f"the download exceeds {cap} bytes, the most this state can take; cut")
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(whole_tensor(parts, len(tensors)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(whole_tensor(parts, len(tensors)))
        wanted = range(len(self._fragments)) if fragments is None else sorted(set(fragments))
        expected = sum(2 * len(self._fragments[f]) for f in wanted if 0 <= f < len(self._fragments))  # Θ, momentum
        if metadata is not None and len(tensors) < expected:
            raise ConnectionError(f"the stream ended after {len(tensors)} of {expected} tensors")
        return (metadata, tensors) if metadata is not None else None

    def download_cap(self, fragments: Sequence[int] | None) -> int:
        """The most bytes a download of ``fragments`` (None: all) may carry: the tensors' fp32 bytes, 1%
        and 64 KiB per tensor for framing, and :data:`MAX_METADATA_BYTES` of metadata."""
        wanted = range(len(self._fragments)) if fragments is None else fragments
        tensors = sum(2 * len(self._fragments[f]) for f in wanted if 0 <= f < len(self._fragments))
        raw = sum(self._served_bytes[f] for f in wanted if 0 <= f < len(self._fragments))
        return int(raw * 1.01) + 65536 * tensors + MAX_METADATA_BYTES

    def get_current_state(self):
        """hivemind's state-sharing hook, run on a thread of the learner's process: what peers download.

        ``state_provider``'s (metadata, tensors) with no tensor infos; an empty state when there is no provider.
        """
        if self._state_provider is None:
            return {}, [], None
        metadata, tensors = self._state_provider()
        return metadata, tensors, None


def whole_tensor(parts: list[Any], index: int) -> torch.Tensor:
    """The tensor in a download's ``parts`` (hivemind's streaming chunks), or ConnectionError when they stop short.

    hivemind ends a stream quietly when its connection closes (an incomplete read counts as its end), so a
    download cut on a slow link arrives as a tensor missing its last chunks: a broken download (the learner tries
    the next peer), not a malformed state (which would make it distrust an honest peer).
    """
    expected = max(1, parts[0].chunks)  # split_for_streaming sends one part even for an empty tensor
    if len(parts) != expected:
        raise ConnectionError(f"the stream ended after {len(parts)} of {expected} chunks of tensor {index}")
    return deserialize_torch_tensor(combine_from_streaming(parts))
