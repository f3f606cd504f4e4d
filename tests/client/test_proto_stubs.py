"""The committed stubs are what scripts/gen_proto.py makes from proto/ today."""

from __future__ import annotations

import pathlib
import tempfile

from harness import load_script


def test_committed_stubs_match_proto():
    gen_proto = load_script("scripts/gen_proto.py")
    with tempfile.TemporaryDirectory() as tmp:
        fresh = gen_proto.generate(pathlib.Path(tmp))
    for name, text in fresh.items():
        committed = (gen_proto.STUB_DIR / name).read_text()
        assert committed == text, f"{name} is stale: run `python scripts/gen_proto.py`"


def test_wire_names_are_the_public_contract():
    from vaed_client._proto import vaed_pb2

    service = vaed_pb2.DESCRIPTOR.services_by_name["VaeDecoder"]
    assert service.full_name == "vaed.v1.VaeDecoder"
    assert {m.name for m in service.methods} == {"GetModelInfo", "Decode", "DecodeStream", "Encode"}
    assert vaed_pb2.DecodeOptions.DESCRIPTOR.fields_by_name["raw_latents"].number == 3
    assert vaed_pb2.FrameChunk.DESCRIPTOR.fields_by_name["final"].number == 5
    assert [v.name for v in vaed_pb2.DataType.DESCRIPTOR.values] == [
        "DATA_TYPE_UNSPECIFIED", "UINT8", "FLOAT16", "BFLOAT16", "FLOAT32",
    ]
