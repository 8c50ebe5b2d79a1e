"""The Hugging Face ``Trainer`` integration (public names re-exported by ``memfit.huggingface``).

``arguments`` reads what the Trainer will run from ``TrainingArguments``; ``planning`` plans the
batch before the Trainer exists; ``evaluation`` predicts evaluation and prediction passes;
``callback`` measures the run and recovers from out-of-memory errors once ``attach``-ed.
"""
