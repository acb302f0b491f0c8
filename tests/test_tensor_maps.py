"""Tensor maps on the host (``cuflash.gpu.tensor_maps``), without a GPU: which arrays the
copy engine takes, and the rewrite of a map's address word, checked against fake
encoders of known formats."""

import ctypes

import pytest

from cuflash.gpu import tensor_maps
from cuflash.gpu.tensor_maps import TileMap


def test_supported_arrays():
    # [B, H, S, D] contiguous, D = 128: rows 256 bytes apart
    m = TileMap((2, 4, 100, 128), (4 * 100 * 128, 100 * 128, 128), 128)
    assert m.supported and m.dims == (128, 100, 4, 2) and m.strides == (2, 256, 25600, 102400)
    assert m.box == (64, 128, 1, 1)
    # rows 44 elements (88 bytes) apart: not a multiple of 16
    assert not TileMap((1, 1, 64, 40), (64 * 44, 64 * 44, 44), 128).supported
    # a [B, S, H, D] buffer viewed as [B, H, S, D]: rows H * D apart, heads D apart
    m = TileMap((1, 8, 50, 64), (50 * 8 * 64, 64, 8 * 64), 64, rows=40)
    assert m.supported and m.dims == (64, 40, 8, 1) and m.strides[1:3] == (1024, 128)
    # one head and one batch entry: their strides never step, any valid one is given
    m = TileMap((1, 1, 16, 8), (0, 0, 8), 128)
    assert m.supported and all(s % 16 == 0 and s > 0 for s in m.strides[1:])
    assert not TileMap((1, 1, 16, 8), (0, 0, 8), 512).supported  # a box of 512 rows
    # float32 rows (the backward's dQ accumulator): 128-byte boxes of 32 columns
    m = TileMap((2, 3, 70, 128), (3 * 70 * 128, 70 * 128, 128), 16, itemsize=4)
    assert m.supported and m.strides == (4, 512, 35840, 107520) and m.box == (32, 16, 1, 1)
    # 44 float32 columns: 176-byte rows, a multiple of 16
    assert TileMap((1, 1, 64, 40), (64 * 44, 64 * 44, 44), 16, itemsize=4).supported


def _fake_encoder(word_of):
    """An encoder that writes 16 words: constants, and ``word_of(address)`` for word 3."""

    def encode(destination, address):
        for w in range(16):
            value = word_of(address) if w == 3 else 1000 + w
            ctypes.c_uint64.from_address(destination + 8 * w).value = value

    return encode


def test_address_word_is_found_when_affine():
    found = tensor_maps._address_word(_fake_encoder(lambda a: (a >> 4) + (7 << 60)))
    assert found == (3, 4, 7 << 60)
    assert tensor_maps._address_word(_fake_encoder(lambda a: a | 5)) == (3, 0, 5)


def test_address_word_refused_otherwise():
    assert tensor_maps._address_word(_fake_encoder(lambda a: (a * 3) & 0xFFFF)) is False

    def two_words(destination, address):
        for w in range(16):
            value = address >> (8 * w) if w in (2, 3) else w
            ctypes.c_uint64.from_address(destination + 8 * w).value = value & ((1 << 64) - 1)

    assert tensor_maps._address_word(two_words) is False


@pytest.mark.parametrize("affine", [True, False])
def test_encode_into_rewrites_the_word_or_encodes_again(affine, monkeypatch):
    calls = []

    def word_of(a):
        return (a >> 4) + 99 if affine else (a * 3) & 0xFFFF

    fake = _fake_encoder(word_of)

    def encode(self, destination, address):
        calls.append(address)
        fake(destination, address)

    monkeypatch.setattr(TileMap, "_encode", encode)
    m = TileMap((1, 1, 64, 64), (4096, 4096, 64), 64)
    buffer = (ctypes.c_uint64 * 24)()
    destination = -(-ctypes.addressof(buffer) // 64) * 64
    for address in (0x10000, 0x20000, 0x30010):
        calls.clear()
        m.encode_into(destination, address)
        got = [ctypes.c_uint64.from_address(destination + 8 * w).value for w in range(16)]
        assert got == [word_of(address) if w == 3 else 1000 + w for w in range(16)]
        probes = len(tensor_maps._PROBES) if address == 0x10000 else 0
        full = 1 if (address == 0x10000 or not affine) else 0
        assert len(calls) == probes + full
