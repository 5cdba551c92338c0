import numpy as np
import numpy.typing as npt

def copy_ranges(dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], size: npt.NDArray[np.int64]) -> None: ...
