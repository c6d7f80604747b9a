"""Models as a new user brings them: a ResNet, Hugging Face GPT-2 and BERT, a
TransformerEncoder, RNNs (an LSTM language model, a packed GRU), a ViT.

Each builder returns ``(model, X, y, individual_loss_fn)``, where ``model(X)`` is the forward
and ``individual_loss_fn(model(X), y)`` the per-sample losses, shape [N]. Models are returned
in train mode, as a training loop would hold them (the ResNet's BatchNorm normalises with
batch statistics and its dropout is active; call ``model.eval()`` where per-sample gradients
must be defined). Parameters and float inputs have ``dtype``; token ids are int64.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence

PAD = 0  # the padding token id of the sequence models


def _classification_losses(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _sequence_losses(out, y: Tensor) -> Tensor:
    """Per-sequence mean token loss of a language model's output (logits [N, T, V])."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)


IGNORE = -100  # the label of a token no loss is taken on (F.cross_entropy's ignore_index)


def _causal_lm_losses(out, y: Tensor) -> Tensor:
    """The causal language-model loss per sequence: logits [N, T, V] at positions 0..T-2
    predict the labels at 1..T-1 (the shift), IGNORE labels (padding) left out, the mean over
    each sequence's kept tokens."""
    logits = out.logits if hasattr(out, "logits") else out
    logits, labels = logits[:, :-1].contiguous(), y[:, 1:]
    n, t, v = logits.shape
    tokens = F.cross_entropy(logits.view(-1, v), labels.reshape(-1), reduction="none")
    kept = (labels != IGNORE).to(tokens.dtype)
    return tokens.view(n, t).sum(1) / kept.sum(1)


def _token_losses_summed(out: Tensor, y: Tensor) -> Tensor:
    """Per sequence, the sum of the token cross-entropies, IGNORE labels left out."""
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none", ignore_index=IGNORE).sum(1)


def _lengths(n: int, t: int, shortest: int) -> Tensor:
    """Sequence lengths in shortest..t: the first fills the batch, the last is padded most."""
    lengths = torch.randint(shortest, t + 1, (n,))
    lengths[0], lengths[-1] = t, shortest
    return lengths


def _padded_tokens(n: int, t: int, vocab: int, lengths: Tensor) -> Tensor:
    """Token ids [n, t] in 1..vocab-1, PAD after each sample's length."""
    tokens = torch.randint(1, vocab, (n, t))
    return tokens.masked_fill(torch.arange(t) >= lengths[:, None], PAD)


# --- ResNet ----------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """He et al. (2016) basic block: two 3x3 convolutions with BatchNorm and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths=(16, 16, 32, 36), classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        self.blocks = nn.Sequential(
            *(
                BasicBlock(cin, cout, 1 if k == 0 else 2)
                for k, (cin, cout) in enumerate(zip(widths[:-1], widths[1:]))
            )
        )
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x):
        h = self.blocks(self.stem(x))
        return self.fc(self.dropout(h.mean((2, 3))))


def basic_block_resnet(
    n: int = 8, seed: int = 0, dtype: torch.dtype = torch.float64, image: int = 16
):
    """BasicBlock ResNet (about 43k parameters) on CIFAR-like 3 x image x image inputs, 10
    classes."""
    torch.manual_seed(seed)
    model = ResNet().to(dtype)
    X, y = torch.randn(n, 3, image, image, dtype=dtype), torch.randint(0, 10, (n,))
    return model, X, y, _classification_losses


# --- GPT-2 -----------------------------------------------------------------------------------
def tiny_gpt2(
    n: int = 4, t: int = 12, seed: int = 0, dtype: torch.dtype = torch.float64, width: int = 32
):
    """The real ``transformers.GPT2LMHeadModel`` from a tiny config (2 layers, ``width``, 2
    heads, vocabulary 64, 16 positions, head tied to the token embedding, eager attention).
    Its position table ``transformer.wpe`` is looked up by ``arange(T)``, without batch axis."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=width,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation="eager",
        bos_token_id=63,
        eos_token_id=63,
    )
    model = GPT2LMHeadModel(config).to(dtype)
    X, y = torch.randint(0, 64, (n, t)), torch.randint(0, 64, (n, t))
    return model, X, y, _sequence_losses


def gpt2_lm(
    n: int = 4, t: int = 12, seed: int = 0, dtype: torch.dtype = torch.float64, width: int = 32
):
    """:func:`tiny_gpt2` trained as a causal language model on right-padded sequences (lengths
    in 3..t): labels are the tokens, IGNORE at the padding, the loss shifted by one position
    (``logits[:, :-1]`` against ``labels[:, 1:]``). Right padding needs no attention mask in a
    causal model (no kept token attends to a later one)."""
    model, _, _, _ = tiny_gpt2(n, t, seed, dtype, width)
    tokens = _padded_tokens(n, t, 64, _lengths(n, t, 3))
    return model, tokens, tokens.masked_fill(tokens == PAD, IGNORE), _causal_lm_losses


class BertClassifier(nn.Module):
    """The real ``transformers.BertForSequenceClassification``, called with the attention mask
    of the PAD tokens, returning its logits."""

    def __init__(self, config):
        super().__init__()
        from transformers import BertForSequenceClassification

        self.bert = BertForSequenceClassification(config)

    def forward(self, tokens):
        return self.bert(input_ids=tokens, attention_mask=(tokens != PAD).long()).logits


def bert_classifier(
    n: int = 4, t: int = 10, seed: int = 0, dtype: torch.dtype = torch.float64, width: int = 32
):
    """A BERT-style classifier from a tiny config (2 layers, ``width``, 2 heads, vocabulary
    40, 3 classes, eager attention) on token ids padded with PAD to lengths in 3..t."""
    from transformers import BertConfig

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=40,
        hidden_size=width,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * width,
        max_position_embeddings=16,
        num_labels=3,
        pad_token_id=PAD,
        attn_implementation="eager",
    )
    model = BertClassifier(config).to(dtype)
    X, y = _padded_tokens(n, t, 40, _lengths(n, t, 3)), torch.randint(0, 3, (n,))
    return model, X, y, _classification_losses


# --- TransformerEncoder ----------------------------------------------------------------------
class EncoderClassifier(nn.Module):
    """Token embedding plus a learned position table added in this forward (a root parameter),
    a 2-layer ``nn.TransformerEncoder`` masking PAD tokens, mean over the unpadded tokens."""

    def __init__(self, vocab: int = 20, width: int = 32, context: int = 10, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=PAD)
        self.pos = nn.Parameter(0.1 * torch.randn(context, width))
        layer = nn.TransformerEncoderLayer(
            width, nhead=2, dim_feedforward=2 * width, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        padding = tokens == PAD
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(h, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def transformer_encoder(
    n: int = 4, t: int = 10, seed: int = 0, dtype: torch.dtype = torch.float64, width: int = 32
):
    """``EncoderClassifier`` on token ids [n, t] padded with PAD to lengths in 3..t."""
    torch.manual_seed(seed)
    model = EncoderClassifier(width=width, context=t).to(dtype)
    lengths = torch.randint(3, t + 1, (n,))
    lengths[0] = t  # the longest sequence fills the batch
    X, y = _padded_tokens(n, t, 20, lengths), torch.randint(0, 3, (n,))
    return model, X, y, _classification_losses


# --- recurrent -------------------------------------------------------------------------------
RECURRENT = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


class RecurrentClassifier(nn.Module):
    """Embedding, one recurrent layer and a linear head on the state after each sample's last
    token. Lengths come from the PAD tokens; ``packed`` runs the layer on a PackedSequence
    (``pack_padded_sequence``, unsorted), otherwise on the padded batch."""

    def __init__(self, kind: str, packed: bool, batch_first: bool, vocab=12, width=6, classes=3):
        super().__init__()
        # (not named batch_first: the engine reads that attribute as the batch axis below it)
        self.packed, self.time_axis = packed, 1 if batch_first else 0
        self.embed = nn.Embedding(vocab, 5, padding_idx=PAD)
        self.rnn = RECURRENT[kind](5, width, batch_first=batch_first)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        time_axis = self.time_axis
        lengths = (tokens != PAD).sum(time_axis)
        h = self.embed(tokens)
        if self.packed:
            packed = pack_padded_sequence(
                h, lengths.cpu(), batch_first=time_axis == 1, enforce_sorted=False
            )
            state = self.rnn(packed)[1]
            last = (state[0] if isinstance(state, tuple) else state)[-1]
        else:
            out = self.rnn(h)[0]
            index = (lengths - 1).view(*((1, -1) if time_axis == 0 else (-1, 1)), 1)
            last = out.gather(time_axis, index.expand(*index.shape[:-1], out.shape[-1]))
            last = last.squeeze(time_axis)
        return self.head(last)


def recurrent(
    kind: str = "lstm",
    packed: bool = False,
    batch_first: bool = True,
    n: int = 4,
    t: int = 5,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
):
    """``RecurrentClassifier`` (``kind``: "lstm", "gru" or "rnn") on token ids padded with PAD
    to lengths in 1..t, shape [n, t] (``batch_first``) or [t, n]."""
    if kind not in RECURRENT:
        raise ValueError(f"kind={kind!r} is not a recurrent layer; use one of {list(RECURRENT)}")
    torch.manual_seed(seed)
    model = RecurrentClassifier(kind, packed, batch_first).to(dtype)
    lengths = torch.randint(1, t + 1, (n,))
    lengths[0] = t
    tokens = _padded_tokens(n, t, 12, lengths)
    X = tokens if batch_first else tokens.T.contiguous()
    return model, X, torch.randint(0, 3, (n,)), _classification_losses


class LSTMLanguageModel(nn.Module):
    """Embedding, a 2-layer LSTM and a linear head: per-token logits [N, T, V]."""

    def __init__(self, vocab: int = 24, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=PAD)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.lstm(self.embed(tokens))[0])


def lstm_lm(
    n: int = 4, t: int = 6, seed: int = 0, dtype: torch.dtype = torch.float64, vocab: int = 24
):
    """``LSTMLanguageModel`` predicting the next token of sequences padded with PAD to lengths
    in 2..t (inputs tokens[:, :-1], labels tokens[:, 1:], IGNORE at the padding), the loss
    the sum of each sequence's token cross-entropies."""
    torch.manual_seed(seed)
    model = LSTMLanguageModel(vocab).to(dtype)
    tokens = _padded_tokens(n, t + 1, vocab, _lengths(n, t + 1, 3))
    labels = tokens[:, 1:].masked_fill(tokens[:, 1:] == PAD, IGNORE)
    return model, tokens[:, :-1].contiguous(), labels, _token_losses_summed


# --- ViT -------------------------------------------------------------------------------------
class ViT(nn.Module):
    """A vision transformer (Dosovitskiy et al. 2021): patches by a strided convolution, a class
    token and a learned position table as parameters of the root module (the token
    concatenated in front of the patches, the table added to the sequence), pre-norm
    ``nn.TransformerEncoder`` layers with GELU modules, the class token's state to the head."""

    def __init__(self, image=8, patch=4, width=16, depth=2, classes=10):
        super().__init__()
        self.patches = nn.Conv2d(3, width, patch, stride=patch)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, width))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, (image // patch) ** 2 + 1, width))
        layer = nn.TransformerEncoderLayer(
            width, 2, 2 * width, dropout=0.0, activation=nn.GELU(), batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images):
        h = self.patches(images).flatten(2).transpose(1, 2)  # [N, P, D]
        h = torch.cat([self.cls_token.expand(len(h), -1, -1), h], dim=1) + self.pos_embed
        return self.head(self.norm(self.encoder(h))[:, 0])


def vit(n: int = 4, seed: int = 0, dtype: torch.dtype = torch.float64, image: int = 8):
    """``ViT`` on 3 x image x image inputs, 10 classes."""
    torch.manual_seed(seed)
    model = ViT(image=image).to(dtype)
    X, y = torch.randn(n, 3, image, image, dtype=dtype), torch.randint(0, 10, (n,))
    return model, X, y, _classification_losses


def packed_gru(n: int = 4, t: int = 5, seed: int = 0, dtype: torch.dtype = torch.float64):
    """:func:`recurrent` with a GRU on a PackedSequence, batch first."""
    return recurrent("gru", packed=True, n=n, t=t, seed=seed, dtype=dtype)


# The three whole models of issue 18 (the recurrent one takes its own arguments).
MODELS = {"resnet": basic_block_resnet, "gpt2": tiny_gpt2, "encoder": transformer_encoder}
# Every architecture of issue 24: each builder takes n, seed and dtype.
ALL_MODELS = {
    "gpt2": gpt2_lm,
    "bert": bert_classifier,
    "encoder": transformer_encoder,
    "resnet": basic_block_resnet,
    "lstm_lm": lstm_lm,
    "packed_gru": packed_gru,
    "vit": vit,
}
