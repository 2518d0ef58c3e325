"""A random-init tiny MiniMax-M3 checkpoint (``m3_helpers.TINY``) with a character tokenizer,
written to a directory."""

import sys
import threading
from pathlib import Path

from tensorrt_llm._torch.models.checkpoint import random_model, save_pretrained
from tensorrt_llm._torch.models.configuration_minimaxm3 import MiniMaxM3Config
from tensorrt_llm.tokenizer import build_char_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "_torch"))
from m3_helpers import TINY  # noqa: E402

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +-*=?.,:\n"
SPECIALS = ["<unk>", "<eos>"]


def write_tiny_checkpoint(
    model_dir: Path,
    seed: int = 0,
    alphabet: str = ALPHABET,
    tokenizer=None,
    eos: str = "<eos>",
    **overrides,
) -> Path:
    """``tokenizer``: in place of a character tokenizer of ``alphabet``; ``eos``: its end token."""
    tokenizer = tokenizer or build_char_tokenizer(alphabet, SPECIALS)
    config = MiniMaxM3Config.from_dict(
        {
            **TINY,
            "vocab_size": tokenizer.get_vocab_size(),
            "max_position_embeddings": 256,
            "index_block_size": 16,
            "eos_token_id": tokenizer.token_to_id(eos),
            **overrides,
        }
    )
    mtp = {"num_mtp_modules": config.num_mtp_modules} if config.num_mtp_modules else {}
    save_pretrained(random_model(config, seed=seed, std=0.15, **mtp), config, model_dir)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


def write_tiny_eagle3(model_dir: Path, target_dir: Path, seed: int = 1, **overrides) -> Path:
    """A random-init Eagle3 drafter for the checkpoint in ``target_dir``: 4 KV heads (the target has
    2), so its per-block size differs from every target buffer."""
    from tensorrt_llm._torch.models.checkpoint import random_eagle3
    from tensorrt_llm._torch.models.modeling_speculative import Eagle3Config

    target = MiniMaxM3Config.from_pretrained(target_dir)
    config = Eagle3Config.from_dict(
        {
            "hidden_size": target.hidden_size,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 8,
            "vocab_size": target.vocab_size,
            "draft_vocab_size": target.vocab_size - 4,
            "target_hidden_size": target.hidden_size,
            **overrides,
        }
    )
    save_pretrained(
        random_eagle3(config, target.num_hidden_layers, seed=seed, std=0.15), config, model_dir
    )
    return model_dir


VL_VISION = dict(  # head_dim 12: 3D RoPE on 3 x 4 channels; patches of 4 pixels, merged 2 x 2
    hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4
)
VL_PREPROCESSOR = {"size": {"shortest_edge": 64, "longest_edge": 32 * 32}}


def write_tiny_vl_checkpoint(model_dir: Path, seed: int = 0, num_mtp_modules: int = 0) -> Path:
    """A random-init tiny MiniMax-M3 with a vision tower (hub layout), a character tokenizer that
    knows the image marks, the plain chat template and a preprocessor config
    (``num_mtp_modules``: with its MTP module)."""
    import json

    from tensorrt_llm.inputs.multimodal_prompts import IMAGE_TOKEN, VISION_END, VISION_START
    from tensorrt_llm.tokenizer import CHAT_ALPHABET, CHAT_SPECIAL_TOKENS, plain_tokenizer_config

    specials = [*CHAT_SPECIAL_TOKENS, IMAGE_TOKEN, VISION_START, VISION_END]
    tokenizer = build_char_tokenizer(CHAT_ALPHABET, specials)
    text = {
        **TINY,
        "vocab_size": tokenizer.get_vocab_size(),
        "index_block_size": 16,
        "eos_token_id": tokenizer.token_to_id("<|end|>"),
        "num_mtp_modules": num_mtp_modules,
    }
    del text["architectures"], text["model_type"], text["dtype"]
    config = MiniMaxM3Config.from_dict(
        {
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "model_type": "minimax_m3_vl",
            "dtype": "float32",
            "text_config": text,
            "vision_config": VL_VISION,
            "projector_hidden_size": 32,
            "image_token_index": tokenizer.token_to_id(IMAGE_TOKEN),
        }
    )
    mtp = {"num_mtp_modules": num_mtp_modules} if num_mtp_modules else {}
    save_pretrained(random_model(config, seed=seed, std=0.15, **mtp), config, model_dir)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = plain_tokenizer_config()
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (model_dir / "preprocessor_config.json").write_text(json.dumps(VL_PREPROCESSOR))
    return model_dir


def staggered_outputs(llm, texts: list[str], params) -> list:
    """The outputs of ``texts``, each submitted once the one before has its first token (from
    the engine loop's thread, between steps): every prompt but the first joins requests that
    are decoding, a mixed step. ``params``: one ``SamplingParams`` for all, or one per text."""
    from tensorrt_llm.llmapi.llm import GenerationRequest

    params = params if isinstance(params, list) else [params] * len(texts)
    outs, started, done = {}, {0}, threading.Event()

    def start(i: int) -> None:
        def update(output) -> None:
            if output.outputs[0].token_ids and i + 1 < len(texts) and i + 1 not in started:
                started.add(i + 1)
                start(i + 1)
            if output.finished:
                outs[i] = output.outputs[0]
                if len(outs) == len(texts):
                    done.set()

        llm.submit(GenerationRequest(texts[i], params[i]), update)

    start(0)
    assert done.wait(600), f"{len(texts) - len(outs)} of {len(texts)} requests did not finish"
    return [outs[i] for i in range(len(texts))]


def write_tiny_m3_chat_checkpoint(model_dir: Path, seed: int = 0) -> Path:
    """A random-init tiny MiniMax-M3 whose tokenizer and chat template are M3's (the markers as
    single tokens, JSON and XML characters, ``examples/templates/minimax_m3.jinja``): what the
    chat protocol and guided decoding tests serve when the output's form, not its sense, is
    under test."""
    import json

    from tensorrt_llm.tokenizer import (
        CHAT_TEMPLATE_FILE,
        M3_ALPHABET,
        M3_SPECIAL_TOKENS,
        M3_TEXT_TOKENS,
    )

    tokenizer = build_char_tokenizer(M3_ALPHABET, M3_SPECIAL_TOKENS, text_tokens=M3_TEXT_TOKENS)
    write_tiny_checkpoint(
        model_dir, seed, tokenizer=tokenizer, eos="[e~[", max_position_embeddings=4096
    )
    special = {"eos_token": "[e~[", "pad_token": "<pad>", "unk_token": "<unk>"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(special))
    template = Path(__file__).parents[3] / "examples" / "templates" / "minimax_m3.jinja"
    (model_dir / CHAT_TEMPLATE_FILE).write_text(template.read_text())
    return model_dir


def guided_m3_client(model: Path | None, serve_in_thread):
    """Yield an ``openai`` client of a live ``trtllm-serve`` of ``model`` (None: the bundled one)
    on the CPU with M3's reasoning and tool parsers and xgrammar; the server stops after."""
    import openai

    from tensorrt_llm.commands.serve import build_server

    server = build_server(
        None if model is None else str(model),
        None,
        device="cpu",
        reasoning_parser="minimax_m3",
        tool_parser="minimax_m3",
        flags={"guided_decoding_backend": "xgrammar", "max_batch_size": 8},
    )
    url, stop = serve_in_thread(server.app)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stop()
    server.close()
