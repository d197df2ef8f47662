"""A store's tokens coded once its codec declares them final (`kvtier.kv.hooks.KVCodec`)."""

from __future__ import annotations

import torch

from kvtier.kv.hooks import RoundTripCodec
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.layout import KVLayout
from kvtier.kv.packed import PackedTier
from kvtier.kv.streams import Streams
from kvtier.kv.tiers import TierAccount


def code_tokens(
    codec: RoundTripCodec,
    start: int,
    upto: int,
    *,
    layout: KVLayout,
    resident: dict[int, torch.Tensor],
    hosts: dict[int, HostSlice],
    packed: PackedTier | None,
    streams: Streams,
    account: TierAccount,
) -> None:
    """Store tokens [start, upto) of every slice coded: resident ones quantized and dequantized
    in place, host ones packed (`PackedTier.encode`, its bytes counted) or, for a simulated
    codec, read back, round-tripped and written again."""
    for buf in resident.values():
        buf[start:upto] = codec.roundtrip(buf[start:upto])
    if packed is not None:
        to_gpu, to_host = packed.encode(hosts, upto, streams)
        account.h2d_bytes += to_gpu
        account.d2h_bytes += to_host
    elif hosts:
        streams.synchronize()  # NOTE: the step's write-backs must land before we rewrite
        tmp = torch.empty(upto - start, 2, layout.group_size, layout.head_dim, dtype=layout.dtype)
        for host in hosts.values():
            host.read_into(tmp, start, upto)
            host.write(start, codec.roundtrip(tmp))
