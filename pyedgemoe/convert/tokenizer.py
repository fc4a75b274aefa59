"""Tokenizer metadata (tokenizer.ggml.*) from a Hugging Face checkpoint, as llama.cpp's converter
writes it, so that llama.cpp's tokenizer reproduces Hugging Face's token ids.

Two kinds, the two the supported families use:
- byte-level BPE from tokenizer.json ("gpt2" in llama.cpp): token list in id order, token types,
  merges and the pre-tokenizer name (see `bpe_pre_tokenizer` for the rule);
- SentencePiece from tokenizer.model ("llama"): pieces, scores, types.
Special token ids, add_bos/add_eos flags and the chat template come from gguf-py's SpecialVocab
(tokenizer.json, tokenizer_config.json, chat_template.jinja, config.json), as in llama.cpp.

Reads files with the `tokenizers` / `sentencepiece` libraries only (no transformers), except the
rare Llama-style tokenizer.json without tokenizer.model, which gguf-py reads through transformers.
"""
from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path

import gguf

from pyedgemoe.errors import ConversionError

# llama.cpp's probe text for identifying a BPE pre-tokenizer (conversion/base.py,
# get_vocab_base_pre): the sha256 of str(token ids) names the pre-tokenizer.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? "
    "'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# The hashes llama.cpp knows for the tokenizers of the supported families (and their close
# relatives), copied from its get_vocab_base_pre; the name is llama.cpp's `tokenizer.ggml.pre`.
KNOWN_PRE_TOKENIZER_HASHES: dict[str, str] = {
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen/Qwen3-Embedding-0.6B
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",  # allenai/OLMo-1.7-7B-hf
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",  # deepseek-llm-7b-base
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",  # deepseek-coder-6.7b
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",  # deepseek-ai/DeepSeek-V3
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",  # databricks/dbrx-base
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",  # microsoft/phi-2
}

# Split regexes of tokenizer.json (before a regex-free ByteLevel) whose llama.cpp pre-tokenizer
# runs the same regex (src/llama-vocab.cpp quotes the originals).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
KNOWN_SPLIT_REGEXES: dict[str, str] = {
    _GPT2_REGEX: "gpt-2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}

# gguf token types (= SentencePiece's piece types)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = (
    gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL,
    gguf.TokenType.USER_DEFINED, gguf.TokenType.UNUSED, gguf.TokenType.BYTE)


# ---------------------------------------------------------------------------------------------
# reading the tokenizer's JSON files: each is checked once, where it is read, for the fields this
# module and gguf-py's readers use, so that a damaged file is one ConversionError naming the file
# and the field (not a KeyError or AttributeError in a reader)


def _read_json(path: Path) -> dict:
    """A JSON file that must hold an object."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None
    except RecursionError:
        raise ConversionError(f"cannot read {path}: JSON nested too deep") from None
    if not isinstance(doc, dict):
        raise ConversionError(f"{path} is not a JSON object: {_show(doc)}")
    return doc


def _show(value) -> str:
    return json.dumps(value)[:60]


def _bad(path: Path, field: str, value, want: str) -> ConversionError:
    return ConversionError(f"{path}: {field} is {_show(value)}, expected {want}")


def _is_text(value) -> bool:
    """A string that can be written as UTF-8 (JSON's \\udXXX escapes can make lone surrogates)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tokenizer_config(hf_dir: Path) -> dict:
    """tokenizer_config.json ({} if there is none); its added tokens are id -> {"content": ...}."""
    path = hf_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    config = _read_json(path)
    decoder = config.get("added_tokens_decoder")
    if decoder is not None and not isinstance(decoder, dict):
        raise _bad(path, "added_tokens_decoder", decoder, "an object of token ids")
    for i, d in (decoder or {}).items():
        if not (i.isascii() and i.isdigit()):
            raise ConversionError(f"{path}: added_tokens_decoder has the key {i!r}, expected a token id")
        if not (isinstance(d, dict) and _is_text(d.get("content"))):
            raise _bad(path, f"added_tokens_decoder[{i!r}]", d, 'an added token {"content": "...", ...}')
    if config.get("add_prefix_space") not in (None, True, False):
        raise _bad(path, "add_prefix_space", config["add_prefix_space"], "true or false")
    _check_chat_template(path, config.get("chat_template"))
    return config


def _check_chat_template(path: Path, template) -> None:
    """A chat template is a string, or a list of named ones (gguf-py writes each)."""
    if template is None or _is_text(template):
        return
    if not (isinstance(template, list)
            and all(isinstance(t, dict) and _is_text(t.get("name")) and _is_text(t.get("template")) for t in template)):
        raise _bad(path, "chat_template", template, 'a string or a list of {"name": ..., "template": ...}')


def _tokenizer_json(hf_dir: Path) -> dict:
    """tokenizer.json: a tokenizer model of a named type, and added tokens with ids and contents."""
    path = hf_dir / "tokenizer.json"
    doc = _read_json(path)
    if "model" not in doc:
        raise ConversionError(f'{path} has no "model" (the tokenizer model): not a Hugging Face tokenizers file')
    model = doc["model"]
    if not (isinstance(model, dict) and isinstance(model.get("type"), str)):
        raise _bad(path, '"model"', model, 'the tokenizer model, an object with its "type"')
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise _bad(path, f'"{key}"', doc[key], "an object or null")
    added = doc.get("added_tokens", [])
    if not isinstance(added, list):
        raise _bad(path, '"added_tokens"', added, "a list")
    for n, d in enumerate(added):
        if not (isinstance(d, dict) and _is_token_id(d.get("id")) and _is_text(d.get("content"))):
            raise _bad(path, f'"added_tokens"[{n}]', d, 'an added token {"id": N, "content": "...", ...}')
    return doc


def _added_tokens_file(hf_dir: Path) -> dict[str, int]:
    """added_tokens.json (SentencePiece tokenizers' extra tokens): content -> token id."""
    path = hf_dir / "added_tokens.json"
    if not path.is_file():
        return {}
    added = _read_json(path)
    for content, i in added.items():
        if not (_is_text(content) and _is_token_id(i)):
            raise _bad(path, f"the token {content!r}", i, "a token id")
    return added


def does_token_look_special(token: str) -> bool:
    """llama.cpp's heuristic for added tokens some models forget to mark special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


# ---------------------------------------------------------------------------------------------
# byte-level BPE (tokenizer.json)


def _load_hf_tokenizer(hf_dir: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConversionError("reading tokenizer.json needs the `tokenizers` package: pip install tokenizers") from None
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise ConversionError(f"{hf_dir} has neither tokenizer.json nor tokenizer.model")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise ConversionError(f"cannot load {path}: {e}") from None


def bpe_pre_tokenizer(tokenizer, tokenizer_json: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE tokenizer.

    The rule, in order:
    1. the sha256 of the ids of CHKTXT is one llama.cpp knows (KNOWN_PRE_TOKENIZER_HASHES): its
       name — the same answer llama.cpp's get_vocab_base_pre gives for those models;
    2. otherwise the pre-tokenizer itself says: a regex-splitting ByteLevel (GPT-2's regex) or
       a Split by a regex of KNOWN_SPLIT_REGEXES followed by a regex-free ByteLevel, no prefix
       space, and no normalizer other than NFC: the llama.cpp pre-tokenizer that runs that
       regex. This covers locally trained tokenizers (the tiny test models use "gpt-2", as
       scripts/tiny_moe.py tells llama.cpp's converter);
    3. otherwise ConversionError: llama.cpp would split the text differently than HF.
    """
    ids = tokenizer.encode(CHKTXT).ids
    chkhsh = sha256(str(list(ids)).encode()).hexdigest()
    if chkhsh in KNOWN_PRE_TOKENIZER_HASHES:
        return KNOWN_PRE_TOKENIZER_HASHES[chkhsh]

    normalizer = tokenizer_json.get("normalizer")
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    ok_normalizer = normalizer is None or normalizer.get("type") == "NFC"
    name = None
    if ok_normalizer and len(steps) == 1 and steps[0].get("type") == "ByteLevel":
        if steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space", False):
            name = "gpt-2"
    elif ok_normalizer and len(steps) == 2 and steps[0].get("type") == "Split" \
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex", True) \
            and not steps[1].get("add_prefix_space", False) and steps[0].get("behavior") == "Isolated" \
            and not steps[0].get("invert", False):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        name = KNOWN_SPLIT_REGEXES.get(regex)
    if name is None:
        raise ConversionError(
            f"llama.cpp has no pre-tokenizer known to split text like this tokenizer.json "
            f"(pre_tokenizer {json.dumps(pre)[:200]}, chkhsh {chkhsh}); its token ids would differ from "
            f"Hugging Face's")
    return name


def _normalize_added_token(tokenizer, token: str, clean_up_spaces: bool) -> str:
    """As transformers' decode(encode(token)): llama.cpp expects added tokens pre-normalized."""
    out = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
    if clean_up_spaces:  # transformers' clean_up_tokenization
        for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
            out = out.replace(a, b)
    return out


def bpe_vocab(hf_dir: Path, vocab_size: int | None) -> tuple[list[str], list[int], str]:
    """(tokens, token types, pre-tokenizer name) as llama.cpp's get_vocab_base computes them."""
    tokenizer = _load_hf_tokenizer(hf_dir)
    tokenizer_json = _tokenizer_json(hf_dir)
    if tokenizer_json["model"]["type"] != "BPE":
        raise ConversionError(f"{hf_dir / 'tokenizer.json'} is a {tokenizer_json['model']['type']} "
                              f"tokenizer; only byte-level BPE and SentencePiece are supported")
    config = _tokenizer_config(hf_dir)
    vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
    # added tokens: the backend's, plus (special flags from) tokenizer_config.json's list
    added: dict[int, tuple[str, bool, bool]] = {}  # id -> (content, special, normalized)
    for i, tok in tokenizer.get_added_tokens_decoder().items():
        added[int(i)] = (tok.content, bool(tok.special), bool(tok.normalized))
    for i, d in (config.get("added_tokens_decoder") or {}).items():
        i = int(i)
        content = d.get("content", added.get(i, ("",))[0])
        special = bool(d.get("special", False)) or (i in added and added[i][1])
        normalized = bool(d.get("normalized", added[i][2] if i in added else True))
        added[i] = (content, special, normalized)
        vocab.setdefault(content, i)
    added_by_content = {content: i for i, (content, _, _) in added.items()}

    if vocab_size is None:
        vocab_size = len(vocab)
    if vocab and max(vocab.values()) >= vocab_size:
        raise ConversionError(f"tokenizer has token id {max(vocab.values())} but config.json says "
                              f"vocab_size={vocab_size}")
    pre = bpe_pre_tokenizer(tokenizer, tokenizer_json)
    clean_up = bool(config.get("clean_up_tokenization_spaces", False))

    reverse = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        token = reverse[i]
        if token in added_by_content:
            info = added.get(i) or added[added_by_content[token]]
            if not info[2]:
                token = _normalize_added_token(tokenizer, token, clean_up)
            if info[1] or does_token_look_special(token):
                types.append(CONTROL)
            else:
                token = token.replace("\u2581", " ")  # pre-normalize user-defined spaces
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(token)
    return tokens, types, pre


def write_bpe(writer: gguf.GGUFWriter, hf_dir: Path, vocab_size: int | None) -> None:
    tokens, types, pre = bpe_vocab(hf_dir, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    _special_vocab(hf_dir, load_merges=True).add_to_gguf(writer, quiet=True)


# ---------------------------------------------------------------------------------------------
# SentencePiece (tokenizer.model)


def _sentencepiece(hf_dir: Path):
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise ConversionError("reading tokenizer.model needs the `sentencepiece` package: "
                              "pip install sentencepiece") from None
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(hf_dir / "tokenizer.model"))
    except Exception as e:
        raise ConversionError(f"cannot load {hf_dir / 'tokenizer.model'}: {e}") from None
    return sp


def spm_vocab(hf_dir: Path, vocab_size: int | None, *, phi3: bool = False) -> tuple[list[bytes], list[float], list[int]]:
    """(pieces, scores, types) as llama.cpp's _create_vocab_sentencepiece computes them, or, with
    phi3=True, as its Phi-3 family does (added tokens also from tokenizer.json, no heuristics)."""
    sp = _sentencepiece(hf_dir)
    n_sp = sp.vocab_size()
    vocab_size = vocab_size or n_sp
    tokens: list[bytes] = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores: list[float] = [-10000.0] * vocab_size
    types: list[int] = [UNUSED] * vocab_size
    for i in range(min(n_sp, vocab_size)):
        tokens[i] = sp.IdToPiece(i).encode("utf-8")
        scores[i] = sp.GetScore(i)
        types[i] = (UNKNOWN if sp.IsUnknown(i) else CONTROL if sp.IsControl(i)
                    else UNUSED if sp.IsUnused(i) else BYTE if sp.IsByte(i) else NORMAL)

    for key, i in _added_tokens_file(hf_dir).items():
        if i < vocab_size:
            tokens[i], scores[i], types[i] = key.encode("utf-8"), -1000.0, USER_DEFINED

    def add(i: int, content: str, special: bool) -> None:
        if i >= vocab_size:
            return
        if phi3:
            types[i] = CONTROL if special else USER_DEFINED
        elif special or does_token_look_special(content):
            types[i] = CONTROL
        else:
            content = content.replace("\u2581", " ")
            types[i] = USER_DEFINED
        tokens[i], scores[i] = content.encode("utf-8"), -1000.0

    for i, d in (_tokenizer_config(hf_dir).get("added_tokens_decoder") or {}).items():
        add(int(i), d["content"], bool(d.get("special")))
    if phi3 and (hf_dir / "tokenizer.json").is_file():
        for d in _tokenizer_json(hf_dir).get("added_tokens", []):
            add(int(d["id"]), d["content"], bool(d.get("special")))
    return tokens, scores, types


def write_spm(writer: gguf.GGUFWriter, hf_dir: Path, vocab_size: int | None, *, phi3: bool = False) -> None:
    tokens, scores, types = spm_vocab(hf_dir, vocab_size, phi3=phi3)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    _special_vocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def is_llama_style(tokenizer_json: dict) -> bool:
    """A Llama-style tokenizer.json (byte-fallback BPE, a Sequence decoder): the test gguf-py's
    LlamaHfVocab makes before reading one (a Llama 3 one, byte_fallback false, is not)."""
    model = tokenizer_json["model"]
    return (model["type"] == "BPE" and bool(model.get("byte_fallback", False))
            and (tokenizer_json.get("decoder") or {}).get("type") == "Sequence")


def write_llama_hf(writer: gguf.GGUFWriter, hf_dir: Path) -> None:
    """A Llama-style tokenizer.json without tokenizer.model, via gguf-py (and transformers)."""
    try:
        vocab = gguf.LlamaHfVocab(hf_dir)
    except ImportError:
        raise ConversionError(f"{hf_dir} has a Llama-style tokenizer.json but no tokenizer.model; reading it "
                              f"needs transformers (pip install transformers), or add tokenizer.model") from None
    except (OSError, ValueError) as e:  # transformers' AutoTokenizer on files it cannot load
        raise ConversionError(f"cannot load the tokenizer of {hf_dir}: {e}") from None
    tokens, scores, types = zip(*vocab.all_tokens())
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    _special_vocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _special_vocab(hf_dir: Path, **kwargs) -> gguf.SpecialVocab:
    """gguf-py's reader of special tokens, merges and the chat template. The JSON files it reads are
    checked here first (config.json was, by HFCheckpoint); within them it walks tokenizer.json's
    merges and post_processor without checking types."""
    if (hf_dir / "tokenizer.json").is_file():
        _tokenizer_json(hf_dir)
    _tokenizer_config(hf_dir)
    if (path := hf_dir / "chat_template.json").is_file():
        _check_chat_template(path, _read_json(path).get("chat_template"))
    try:
        return gguf.SpecialVocab(hf_dir, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConversionError(f"cannot read special tokens of {hf_dir}: {e}") from None


# ---------------------------------------------------------------------------------------------
# per family (llama.cpp's set_vocab of each model class)


def write_vocab(writer: gguf.GGUFWriter, hf_dir: Path, vocab_size: int | None, style: str) -> None:
    """style: "bpe" (Qwen-MoE, OLMoE, DeepSeek-V2: llama.cpp's _set_vocab_gpt2), "llama" (Mixtral:
    tokenizer.model, else a Llama-style tokenizer.json, else BPE), "phi3" (Phi-MoE: BPE when
    tokenizer_class is GPT2Tokenizer, else tokenizer.model)."""
    hf_dir = Path(hf_dir)
    if style == "bpe":
        write_bpe(writer, hf_dir, vocab_size)
    elif style == "llama":
        config = _tokenizer_config(hf_dir)
        if (add_prefix_space := config.get("add_prefix_space")) is not None:
            writer.add_add_space_prefix(add_prefix_space)
        if (hf_dir / "tokenizer.model").is_file():
            write_spm(writer, hf_dir, vocab_size)
        elif (hf_dir / "tokenizer.json").is_file() and is_llama_style(_tokenizer_json(hf_dir)):
            write_llama_hf(writer, hf_dir)
        else:
            write_bpe(writer, hf_dir, vocab_size)
    elif style == "phi3":
        if _tokenizer_config(hf_dir).get("tokenizer_class") == "GPT2Tokenizer":
            write_bpe(writer, hf_dir, vocab_size)
        elif not (hf_dir / "tokenizer.model").is_file():
            raise ConversionError(f"{hf_dir} has no tokenizer.model (Phi-MoE uses a SentencePiece tokenizer)")
        else:
            write_spm(writer, hf_dir, vocab_size, phi3=True)
    else:
        raise ValueError(f"unknown tokenizer style {style!r}")
