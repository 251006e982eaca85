"""Settings for every pytest run of this repository (notebooks and tests/).

nbval reads a kernel's messages only after each cell has finished. 06's study cell drew ~1,150 progress-bar messages
(a bar per point, task and dataset map), past ZMQ's 1,000-message queues: the cell's end could be dropped, and nbval
then failed with "Timeout of 5 seconds exceeded waiting for output". Under test the bars are off (kernels inherit
the environment): 281 messages. Users' runs keep their progress bars.
"""

import os

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
