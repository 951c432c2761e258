"""minidist.state: what a run reads and leaves behind.

  data.py             byte-level text: the tokenizer, the corpus, the split, the global-batch sampler
  tokenizer.py        a byte-level BPE trained with Hugging Face tokenizers (``python -m minidist.state.tokenizer``)
  bpe.py              the same BPE training loop in one screen of Python, for readers
  shards.py           token shards: the format, and reading them memory-mapped (``--data DIR``)
  prepare.py          a corpus tokenized into shards (``python -m minidist.state.prepare``)
  checkpoint_meta.py  a checkpoint's metadata checked as untrusted input, before any file is read
  checkpoint.py       sharded checkpoints, written atomically and read back on any mesh
  export.py           a checkpoint as a Hugging Face GPT-2 or Llama (``python -m minidist.state.export``)
  generate.py         sampling text from a checkpoint (``python -m minidist.state.generate``)

Imports the layers below it (host, layout, model, comm, parallel), never the instruments or
the training command.
"""
