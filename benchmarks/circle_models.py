"""Third-party models for benchmarks/circle.py: Hugging Face architectures built from small
configs with random weights (no download), each with example inputs, and DenseNet-121.

timm is not used: it needs torchvision, whose wheel for this torch is a CUDA build that
breaks ``import torch`` here (see MEASURING.md); transformers carries the same families
(ResNet, ConvNeXt, RegNet, PoolFormer, MobileViT, ViT, Swin) as its own code.
"""

from __future__ import annotations

import torch


class _Outputs(torch.nn.Module):
    """A transformers model returning its tensors as a tuple (no ModelOutput, no cache),
    its weights redrawn (:func:`_randomize`)."""

    def __init__(self, model: torch.nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.model = _randomize(model)
        self.keys = keys
        self.eval()

    def forward(self, *args):
        out = self.model(*args, return_dict=True)
        return tuple(out[k] for k in self.keys)


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Weights with the scale a trained model has: transformers' initialization zeroes the
    last BatchNorm of residual blocks and draws conv/linear weights at std 0.02, so a deep
    random CNN (MobileViT) outputs exact zeros, and a comparison of zeros proves nothing.
    Matrices get std 1/sqrt(fan_in); norms weight ~U(0.5, 1.5), bias and running mean
    ~N(0, 0.1), running variance ~U(0.5, 1.5)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            last = name.rsplit(".", 1)[-1]
            if tensor.dim() >= 2:
                fan_in = tensor[0].numel()
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / fan_in**0.5)
            elif last in ("running_var", "weight"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
            elif last in ("bias", "running_mean"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    return model


def _image(size: int = 64) -> tuple[torch.Tensor]:
    return (torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0)),)


def _tokens(vocab: int, length: int = 16, mask: bool = True) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(0))
    if not mask:
        return (ids,)
    attention = torch.ones(2, length, dtype=torch.long)
    attention[1, length // 2 :] = 0
    return ids, attention


def _vision(config_cls, model_cls, size=64, keys=("last_hidden_state",), **config):
    def make():
        torch.manual_seed(0)
        model = model_cls(config_cls(**config))
        return _Outputs(model, keys), _image(size)

    return make


def _text(config_cls, model_cls, keys=("last_hidden_state",), mask=True, **config):
    def make():
        torch.manual_seed(0)
        cfg = config_cls(**config)
        model = model_cls(cfg)
        return _Outputs(model, keys), _tokens(cfg.vocab_size, mask=mask)

    return make


def _wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    audio = torch.randn(1, 1600, generator=torch.Generator().manual_seed(0))
    return _Outputs(Wav2Vec2Model(config), ("last_hidden_state",)), (audio,)


class _DenseLayer(torch.nn.Module):
    def __init__(self, channels: int, growth: int):
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 4 * growth, 1, bias=False),
            nn.BatchNorm2d(4 * growth),
            nn.ReLU(),
            nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False),
        )

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.body(torch.cat(features, 1))


class DenseNet(torch.nn.Module):
    """DenseNet-121's structure (Huang et al. 2017: growth 32, blocks of 6, 12, 24, 16
    layers, each layer reading the concatenation of every earlier feature map), written
    here because torchvision cannot be installed next to this torch."""

    def __init__(self, blocks=(6, 12, 24, 16), growth: int = 32, classes: int = 10):
        super().__init__()
        nn = torch.nn
        channels = 2 * growth
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 7, 2, 3, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        self.blocks = nn.ModuleList()
        self.transitions = nn.ModuleList()
        for i, layers in enumerate(blocks):
            block = nn.ModuleList()
            for _ in range(layers):
                block.append(_DenseLayer(channels, growth))
                channels += growth
            self.blocks.append(block)
            if i + 1 < len(blocks):
                self.transitions.append(
                    nn.Sequential(
                        nn.BatchNorm2d(channels),
                        nn.ReLU(),
                        nn.Conv2d(channels, channels // 2, 1, bias=False),
                        nn.AvgPool2d(2),
                    )
                )
                channels //= 2
        self.head = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU())
        self.classifier = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            features = [x]
            for layer in block:
                features.append(layer(features))
            x = torch.cat(features, 1)
            if i < len(self.transitions):
                x = self.transitions[i](x)
        x = self.head(x).mean((2, 3))
        return self.classifier(x)


def _densenet():
    torch.manual_seed(0)
    return _randomize(DenseNet()).eval(), _image(64)


def third_party_models() -> dict:
    """Name → a function building (model in eval mode, example inputs)."""
    import transformers as T

    small_text = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    return {
        "hf_resnet": _vision(
            T.ResNetConfig, T.ResNetModel, hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16
        ),
        "hf_convnext": _vision(
            T.ConvNextConfig, T.ConvNextModel, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2
        ),
        "hf_regnet": _vision(  # grouped convolutions
            T.RegNetConfig,
            T.RegNetModel,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            embedding_size=16,
            groups_width=8,
        ),
        "hf_poolformer": _vision(  # group_norm
            T.PoolFormerConfig,
            T.PoolFormerModel,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            num_encoder_blocks=2,
            patch_sizes=[7, 3],
            strides=[4, 2],
            padding=[2, 1],
        ),
        "hf_mobilevit": _vision(
            T.MobileViTConfig,
            T.MobileViTModel,
            image_size=64,
            hidden_sizes=[24, 32, 40],
            neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
        ),
        "hf_vit": _vision(
            T.ViTConfig,
            T.ViTModel,
            image_size=64,
            patch_size=16,
            intermediate_size=64,
            **small_text,
        ),
        "hf_bert_small": _text(T.BertConfig, T.BertModel, intermediate_size=64, **small_text),
        "hf_roberta": _text(T.RobertaConfig, T.RobertaModel, intermediate_size=64, **small_text),
        "hf_distilbert": _text(
            T.DistilBertConfig, T.DistilBertModel, dim=32, n_layers=2, n_heads=2, hidden_dim=64
        ),
        "hf_albert": _text(
            T.AlbertConfig, T.AlbertModel, embedding_size=16, intermediate_size=64, **small_text
        ),
        "hf_electra": _text(
            T.ElectraConfig, T.ElectraModel, embedding_size=16, intermediate_size=64, **small_text
        ),
        "hf_gpt2": _text(
            T.GPT2Config, T.GPT2Model, mask=False, n_embd=32, n_layer=2, n_head=2, use_cache=False
        ),
        "hf_clip_text": _text(
            T.CLIPTextConfig,
            T.CLIPTextModel,
            keys=("last_hidden_state", "pooler_output"),
            intermediate_size=64,
            **small_text,
        ),
        "hf_wav2vec2": _wav2vec2,
        "densenet121": _densenet,
    }


class _DecodeStep(torch.nn.Module):
    """One decode step of a transformers causal LM with its DynamicCache as plain tensors
    (keys and values per layer, in and out), the form both converters take."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model.eval()

    def forward(self, input_ids, *cache):
        from transformers import DynamicCache

        past = DynamicCache()
        for layer in range(len(cache) // 2):
            past.update(cache[2 * layer], cache[2 * layer + 1], layer)
        out = self.model(input_ids=input_ids, past_key_values=past, use_cache=True)
        grown = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *grown)


def _decoder(config_cls, model_cls, step: str, **config):
    """A transformers decoder (hidden 64, 2 layers, grouped-query attention) as a prefill
    of 16 tokens with a padding mask, or as a decode step on a 15-token cache."""

    def make():
        torch.manual_seed(0)
        common = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=64,
        )
        cfg = config_cls(**common, **config)
        model = _randomize(model_cls(cfg)).eval()
        if step == "prefill":
            cfg.use_cache = False
            return _Outputs(model, ("logits",)), _tokens(cfg.vocab_size)
        ids = torch.randint(0, cfg.vocab_size, (1, 15), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
        tensors = tuple(
            t.contiguous() for layer in cache.layers for t in (layer.keys, layer.values)
        )
        token = torch.randint(0, cfg.vocab_size, (1, 1), generator=torch.Generator().manual_seed(1))
        return _DecodeStep(model).eval(), (token, *tensors)

    return make


def decoder_models() -> dict:
    """Name → a function building (decoder in eval mode, example inputs): transformers'
    Llama, Qwen2, Mistral and Gemma 3, each as a prefill and as a decode step."""
    import transformers as T

    families = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": 32}),
        "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, {"head_dim": 16, "sliding_window": 32}),
    }
    return {
        f"hf_{name}_{step}": _decoder(config_cls, model_cls, step, **extra)
        for name, (config_cls, model_cls, extra) in families.items()
        for step in ("prefill", "decode")
    }


#: timm architectures whose Circle files were once refused or wrong (issue 39).
TIMM = ("mobilevit_xxs", "inception_v3", "dla34", "convnext_atto", "edgenext_xx_small")


def timm_models(size: int = 128) -> dict:
    """timm's models by name (random weights at a trained model's scale, one image of
    ``size``), or {} when timm is not installed.

    timm's package imports torchvision at import time, for code these models never run;
    torchvision's wheel for this torch is a CUDA build that breaks ``import torch`` here
    (MEASURING.md). Install timm with ``pip install --no-deps timm``: where torchvision is
    missing, :func:`_torchvision_stand_in` lets the import through, and any use of a
    torchvision name raises.
    """
    try:
        import torchvision  # noqa: F401
    except ImportError:
        _torchvision_stand_in()
    try:
        import timm
    except ImportError:
        return {}

    def make(name: str):
        torch.manual_seed(0)
        model = _randomize(timm.create_model(name, pretrained=False)).eval()
        return model, _image(size)

    return {f"timm_{name}": (lambda name=name: make(name)) for name in TIMM}


def _torchvision_stand_in() -> None:
    """A ``torchvision`` package of empty modules: every class or function in it raises
    when called, every enum member is its own name (``InterpolationMode.NEAREST``)."""
    import importlib.abc
    import importlib.machinery
    import sys
    import types

    class Missing(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return name

    class Unavailable(metaclass=Missing):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("torchvision is not installed (an import stand-in for timm)")

    class Package(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            if name[:1].islower():
                return importlib.import_module(f"{self.__name__}.{name}")
            return Unavailable

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = Package(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            module.__version__ = "0.0"

    sys.meta_path.append(Finder())
