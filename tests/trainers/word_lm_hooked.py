"""pytorch/examples' word-level language model trainer, small, with runhealth attached.

    python word_lm_hooked.py --data ./data/synth --epochs 6

Written as ``word_language_model/main.py`` (pytorch/examples 28d16ff, the newest change to that
file in the 77f55b9 snapshot) is, on purpose: configuration by argparse with its defaults
(``--lr 20``, ``--clip 0.25``, ``--bptt 35``, ``--batch_size 20``, ``--save model.pt``, a relative
path in the working directory); a ``Corpus`` read from ``train.txt``/``valid.txt``/``test.txt``
under ``--data``; ``batchify`` into columns and ``get_batch`` chunks of ``bptt`` rows whose
targets are the next rows flattened (one-dimensional, already shifted); an ``RNNModel`` (LSTM)
with ``log_softmax`` and ``NLLLoss``; the hidden state carried across batches, detached, and
reset at each epoch; **no optimizer object**: ``clip_grad_norm_`` then a manual SGD update
``p.data.add_(p.grad, alpha=-lr)`` with a module-global ``lr`` that is divided by 4 after each
epoch whose validation loss did not improve; the whole model pickled (``torch.save(model, f)``)
to ``--save`` whenever the validation loss is the best so far, overwritten in place, and loaded
back for the test evaluation. No resume. Only the sizes are small (the test writes a synthetic
corpus of a learnable word stream), and it runs on the CPU with one thread.

runhealth is attached by the README's recipes, every added or changed line marked ``+``: the
hook around the training (no optimizer to pass), ``rh.windows`` over the batch offsets (one
window per update, ``sample_ids`` the offset), ``rh.loss`` with the flat targets and
``rh.grad_norm``, ``rh.checkpoint_saved`` after the best model is saved, and
``handle_rollback`` after each epoch's training, which needs the ``for`` over epochs made a
``while`` (a rollback goes back to the saved epoch). The test knobs: ``--nan_at=STEP`` (that
update's loss is NaN; updates counted from 1 over the whole run) and ``--x3_at=STEP`` (its loss
is tripled), each once per process, and ``--step_sleep`` (seconds added to each update).
"""

import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from collectors import RunHealth, handle_rollback  # +

parser = argparse.ArgumentParser(description="PyTorch Wikitext-2 RNN/LSTM/GRU/Transformer Language Model")
parser.add_argument("--data", type=str, default="./data/wikitext-2", help="location of the data corpus")
parser.add_argument(
    "--model", type=str, default="LSTM", help="type of network (RNN_TANH, RNN_RELU, LSTM, GRU)"
)
parser.add_argument("--emsize", type=int, default=200, help="size of word embeddings")
parser.add_argument("--nhid", type=int, default=200, help="number of hidden units per layer")
parser.add_argument("--nlayers", type=int, default=2, help="number of layers")
parser.add_argument("--lr", type=float, default=20, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--epochs", type=int, default=40, help="upper epoch limit")
parser.add_argument("--batch_size", type=int, default=20, metavar="N", help="batch size")
parser.add_argument("--bptt", type=int, default=35, help="sequence length")
parser.add_argument("--dropout", type=float, default=0.2, help="dropout applied to layers (0 = no dropout)")
parser.add_argument("--tied", action="store_true", help="tie the word embedding and softmax weights")
parser.add_argument("--seed", type=int, default=1111, help="random seed")
parser.add_argument("--log-interval", type=int, default=200, metavar="N", help="report interval")
parser.add_argument("--save", type=str, default="model.pt", help="path to save the final model")
parser.add_argument("--nan_at", type=int, default=-1)  # the test's knobs
parser.add_argument("--x3_at", type=int, default=-1)
parser.add_argument("--step_sleep", type=float, default=0.0)
args = parser.parse_args()

torch.manual_seed(args.seed)
torch.set_num_threads(1)
device = torch.device("cpu")

###############################################################################
# Load data (word_language_model/data.py)
###############################################################################


class Dictionary:
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class Corpus:
    def __init__(self, path):
        self.dictionary = Dictionary()
        self.train = self.tokenize(os.path.join(path, "train.txt"))
        self.valid = self.tokenize(os.path.join(path, "valid.txt"))
        self.test = self.tokenize(os.path.join(path, "test.txt"))

    def tokenize(self, path):
        assert os.path.exists(path)
        with open(path, encoding="utf8") as f:
            for line in f:
                for word in [*line.split(), "<eos>"]:
                    self.dictionary.add_word(word)
        with open(path, encoding="utf8") as f:
            idss = []
            for line in f:
                ids = [self.dictionary.word2idx[word] for word in [*line.split(), "<eos>"]]
                idss.append(torch.tensor(ids).type(torch.int64))
            ids = torch.cat(idss)
        return ids


corpus = Corpus(args.data)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


eval_batch_size = 10
train_data = batchify(corpus.train, args.batch_size)
val_data = batchify(corpus.valid, eval_batch_size)
test_data = batchify(corpus.test, eval_batch_size)

###############################################################################
# Build the model (word_language_model/model.py, the RNN part)
###############################################################################


class RNNModel(nn.Module):
    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (
                weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid),
            )
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


ntokens = len(corpus.dictionary)
model = RNNModel(args.model, ntokens, args.emsize, args.nhid, args.nlayers, args.dropout, args.tied).to(
    device
)
criterion = nn.NLLLoss()

###############################################################################
# Training code
###############################################################################


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i : i + seq_len]
    target = source[i + 1 : i + 1 + seq_len].view(-1)
    return data, target


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


injected = set()  # the test's faults, each once per process
offsets = range(0, train_data.size(0) - 1, args.bptt)  # + named: the batches of an epoch


def train():
    model.train()
    total_loss = 0.0
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(rh.windows(offsets, sample_ids=lambda i: [i])):  # + a window per update
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        step = (epoch - 1) * len(offsets) + batch + 1
        for at, factor in ((args.nan_at, math.nan), (args.x3_at, 3.0)):
            if step == at and at not in injected:
                loss = loss * factor
                injected.add(at)
        rh.loss(loss, labels=targets)  # +
        loss.backward()

        rh.grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))  # + (wrapped)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        time.sleep(args.step_sleep)

        total_loss += loss.item()

        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print(
                f"| epoch {epoch:3d} | {batch:5d}/{len(train_data) // args.bptt:5d} batches | lr {lr:02.2f} | ms/batch {elapsed * 1000 / args.log_interval:5.2f} | "
                f"loss {cur_loss:5.2f} | ppl {math.exp(cur_loss):8.2f}"
            )
            total_loss = 0
            start_time = time.time()


def load_best(path):  # + the rollback's load: the pickled model's weights into the live model
    with open(path, "rb") as f, torch.serialization.safe_globals(SAFE_GLOBALS):  # +
        model.load_state_dict(torch.load(f).state_dict())  # +


SAFE_GLOBALS = [RNNModel, nn.Dropout, nn.Linear, nn.GRU, nn.LSTM, nn.RNN, nn.Embedding]

# Loop over epochs.
lr = args.lr
best_val_loss = None

rh = RunHealth(model=model).start()  # + closed at exit; no optimizer: each window is an update
try:
    epoch = 1  # +
    while epoch <= args.epochs:  # + was: for epoch in range(1, args.epochs + 1)
        epoch_start_time = time.time()
        train()
        if (rollback := handle_rollback(rh, load_best)) is not None:  # +
            epoch = rollback.checkpoint_step // len(offsets) + 1  # + the epoch after the saved one
            continue  # +
        val_loss = evaluate(val_data)
        print("-" * 89)
        print(
            f"| end of epoch {epoch:3d} | time: {time.time() - epoch_start_time:5.2f}s | valid loss {val_loss:5.2f} | valid ppl {math.exp(val_loss):8.2f}"
        )
        print("-" * 89)
        if not best_val_loss or val_loss < best_val_loss:
            with open(args.save, "wb") as f:
                torch.save(model, f)
            rh.checkpoint_saved(epoch * len(offsets), args.save)  # +
            best_val_loss = val_loss
        else:
            lr /= 4.0
        epoch += 1  # +
except KeyboardInterrupt:
    print("-" * 89)
    print("Exiting from training early")

with open(args.save, "rb") as f, torch.serialization.safe_globals(SAFE_GLOBALS):
    model = torch.load(f)
    model.rnn.flatten_parameters()

test_loss = evaluate(test_data)
print("=" * 89)
print(f"| End of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}")
print("=" * 89)
