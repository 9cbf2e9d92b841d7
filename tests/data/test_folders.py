"""Image-folder walks: links are followed but no directory is read twice (a loop ends), unreadable roots
get a clear error, and errors give counts, never the names inside the folder (it may be any server path)."""

import os

import pytest
from PIL import Image

from oodviz.data import load_dataset


def _png(path, value=(0, 0, 0)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), value).save(path)


def _names(dataset, root):
    return [os.path.relpath(f, root) for f in dataset.source.files]


def test_a_link_loop_ends_and_each_image_is_read_once(tmp_path):
    _png(tmp_path / "a" / "one.png")
    (tmp_path / "a" / "back-to-root").symlink_to(tmp_path, target_is_directory=True)
    # One loop: the old walk went round it until the path grew too long (hundreds of copies); two links
    # in one folder made that exponential, a hang.
    dataset = load_dataset("folder", path=str(tmp_path), layout="flat")
    assert _names(dataset, tmp_path) == ["a/one.png"]


def test_a_link_to_a_folder_already_read_is_not_read_again(tmp_path):
    _png(tmp_path / "x" / "one.png")
    _png(tmp_path / "y" / "two.png")
    (tmp_path / "y" / "also-x").symlink_to(tmp_path / "x", target_is_directory=True)
    assert _names(load_dataset("folder", path=str(tmp_path), layout="flat"), tmp_path) == ["x/one.png", "y/two.png"]


def test_a_link_into_another_class_does_not_label_its_images_twice(tmp_path):
    _png(tmp_path / "cat" / "c.png")
    _png(tmp_path / "dog" / "d.png")
    (tmp_path / "dog" / "cats-too").symlink_to(tmp_path / "cat", target_is_directory=True)
    (tmp_path / "dog" / "root").symlink_to(tmp_path, target_is_directory=True)
    dataset = load_dataset("folder", path=str(tmp_path))
    assert _names(dataset, tmp_path) == ["cat/c.png", "dog/d.png"]
    assert list(dataset.labels) == [0, 1]


def test_a_link_outside_the_folder_is_followed_once(tmp_path):
    """Links are a feature (a folder of links to images elsewhere); only repeats are dropped."""
    _png(tmp_path / "elsewhere" / "e.png")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert _names(load_dataset("folder", path=str(tmp_path / "data"), layout="flat"), tmp_path / "data") == [
        "link/e.png"
    ]


def test_a_root_that_is_a_file_or_missing_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not a folder")
    with pytest.raises(ValueError, match=r"notes\.txt is a file, not a directory; give the folder"):
        load_dataset("folder", path=str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match=r"missing does not exist$"):
        load_dataset("folder", path=str(tmp_path / "missing"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every folder: no unreadable one can be made")
def test_an_unreadable_root_is_a_clear_error(tmp_path):
    locked = tmp_path / "locked"
    _png(locked / "a.png")
    locked.chmod(0)
    try:
        with pytest.raises(ValueError, match=r"locked cannot be read \(Permission denied\)"):
            load_dataset("folder", path=str(locked))
    finally:
        locked.chmod(0o755)


def test_errors_name_no_subfolder_or_file_of_the_folder(tmp_path):
    """A folder like /etc (subfolders without images): the errors say what layout is expected, with counts."""
    for name in ("secret-keys", "shadow-copies", "private"):
        (tmp_path / name / "inner").mkdir(parents=True)
        (tmp_path / name / "inner" / "settings.conf").write_text("x")
    with pytest.raises(ValueError) as empty:
        load_dataset("folder", path=str(tmp_path))
    message = str(empty.value)
    assert "3 of the 3 subfolder(s)" in message and "path/<class>/<image>" in message
    _png(tmp_path / "hidden-name.png")
    with pytest.raises(ValueError) as loose:
        load_dataset("folder", path=str(tmp_path))
    assert "3 class subfolder(s) and also 1 image(s)" in str(loose.value)
    for error in (message, str(loose.value)):
        assert not any(name in error for name in ("secret", "shadow", "private", "inner", "settings", "hidden-name"))
