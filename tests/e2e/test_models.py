"""GET /v1/models on the real server (the session's SmolLM2, float32): each entry keeps OpenAI's fields and adds
`details`, checked against the GGUF file read by the `gguf` package's own reader in this process."""
from __future__ import annotations

import httpx
import openai
from gguf import GGUFReader, LlamaFileType

from engine.registry import KNOWN_MODELS

MODEL = "smollm2-135m"


def test_the_model_entry_describes_the_served_model_from_its_file(http: httpx.Client, client: openai.OpenAI) -> None:
    path = KNOWN_MODELS[MODEL].path()
    reader = GGUFReader(path)
    listed = http.get("/v1/models").json()
    assert listed["object"] == "list" and len(listed["data"]) == 1
    card = listed["data"][0]
    assert {k: card[k] for k in ("id", "object", "owned_by")} == {"id": MODEL, "object": "model",
                                                                   "owned_by": "emberserve"}
    assert isinstance(card["created"], int) and card["max_model_len"] > 0
    details = card["details"]
    assert details["parameters"] == sum(int(t.n_elements) for t in reader.tensors)
    assert details["parameter_size"] == reader.fields["general.size_label"].contents()  # "135M"
    file_type = LlamaFileType(reader.fields["general.file_type"].contents())
    assert details["quantization_level"] == file_type.name.removeprefix("MOSTLY_") == "Q4_1"
    assert details["context_length"] == reader.fields["llama.context_length"].contents()
    assert details["family"] == reader.fields["general.architecture"].contents() == "llama"
    assert (details["format"], details["size"]) == ("gguf", path.stat().st_size)
    assert details["chat_tuned"] is True and details["embedding"] is False  # SmolLM2-135M-Instruct
    assert (details["quant"], details["dtype"]) == ("none", "float32")  # the session server's --dtype float32
    assert http.get(f"/v1/models/{MODEL}").json() == card
    assert client.models.retrieve(MODEL).model_extra["details"] == details  # the official client keeps them
