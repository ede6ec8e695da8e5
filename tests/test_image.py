"""Fast structure checks of the SD-card image that build-image.sh produces.

A small Debian root (mmdebstrap --variant=essential + systemd, host
architecture, cached) stands in for the full arm64 root: everything the script
adds on top of the Debian packages — users, units, config, fstab, boot
partition, genimage layout — is the same code path as a real build. The image
is then inspected without mounting it: sfdisk, mtools, e2fsck, debugfs and
systemd-analyze.

Needs root and the Debian packages listed in docs/image.md; each test skips
with the reason when one is missing. The slow boot test is `make test-image`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "build-image.sh"
CACHE = Path(os.environ.get("APPLIANCE_IMAGE_CACHE", Path.home() / ".cache" / "appliance-image"))
DISK_SIG = "a1b2c3d4"
HOSTNAME = "citest"
ADMIN = "pilot"
HAT = "respeaker-2mic-v1"
MiB = 1024 * 1024

TOOLS = {
    "mmdebstrap": "mmdebstrap",
    "genimage": "genimage",
    "mkdosfs": "dosfstools",
    "mcopy": "mtools",
    "mdir": "mtools",
    "mke2fs": "e2fsprogs",
    "e2fsck": "e2fsprogs",
    "debugfs": "e2fsprogs",
    "sfdisk": "fdisk",
    "systemd-analyze": "systemd",
    "ssh-keygen": "openssh-client",
}


def _missing_tools() -> list[str]:
    return [f"{t} ({p})" for t, p in TOOLS.items() if shutil.which(t) is None]


def _require_env() -> None:
    missing = _missing_tools()
    if missing:
        pytest.skip("image tools missing: " + ", ".join(missing))
    if os.geteuid() != 0:
        pytest.skip("build-image.sh must run as root (it writes file owners into the image)")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    return subprocess.run([str(c) for c in cmd], **kw)


def _host_suite() -> str:
    """Suite of the small root: the host's own Debian release when it is one,
    so that the host's systemd-analyze understands the root's unit files."""
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return "trixie"
    m = re.search(r"^VERSION_CODENAME=(\w+)", text, re.M)
    if "ID=debian" in text and m:
        return m.group(1)
    return "trixie"


def _host_arch() -> str:
    return _run(["dpkg", "--print-architecture"]).stdout.strip()


@pytest.fixture(scope="session")
def small_root_tar() -> Path:
    _require_env()
    suite, arch = _host_suite(), _host_arch()
    tar = CACHE / "test" / f"small-{suite}-{arch}-v3.tar"
    if not tar.exists():
        tar.parent.mkdir(parents=True, exist_ok=True)
        part = tar.with_suffix(".part.tar")
        _run(
            [
                "mmdebstrap", "--variant=essential", f"--arch={arch}",
                "--include=systemd,systemd-sysv,passwd,procps,login,openssh-client,sudo,iso-codes,nftables",
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                suite, part,
                os.environ.get("APPLIANCE_TEST_MIRROR", "http://deb.debian.org/debian"),
            ],
            timeout=900,
        )
        part.rename(tar)
    return tar


@pytest.fixture(scope="session")
def config_file(tmp_path_factory) -> Path:
    cfg = REPO / "config.yaml"
    if cfg.exists():
        return cfg
    # The repository's config.yaml is what real images carry; until it
    # exists, any YAML file exercises the same code path.
    p = tmp_path_factory.mktemp("cfg") / "config.yaml"
    p.write_text("# test config\naudio:\n  input: default\n")
    return p


@pytest.fixture(scope="session")
def built(small_root_tar, config_file, tmp_path_factory):
    """Build the image once; yield paths and parameters for the checks."""
    d = tmp_path_factory.mktemp("image")
    # Snapshot the config: the repository's copy may be edited while tests run.
    snapshot = d / "config.yaml"
    shutil.copyfile(config_file, snapshot)
    config_file = snapshot
    key = d / "id_ed25519"
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ci@test", "-f", key])
    out = d / "out"
    cmd = [
        SCRIPT, "--target", "qemu", "--rootfs-tar", small_root_tar, "--arch", _host_arch(),
        "--skip-python", "--no-models", "--config", config_file,
        "--ssh-key", f"{key}.pub", "--hostname", HOSTNAME, "--user", ADMIN, "--hat", HAT,
        "--version", "0.0.0-ci", "--out", out, "--root-size", "1G",
        "--disk-signature", DISK_SIG, "--no-compress", "--keep-work",
        "--cache", d / "cache",
    ]
    res = _run(cmd, check=False, timeout=600)
    if res.returncode != 0:
        pytest.fail(f"build-image.sh failed ({res.returncode}):\n{res.stderr[-4000:]}")
    img = out / "appliance-0.0.0-ci-qemu.img"
    assert img.exists(), res.stderr[-2000:]
    parts = _partitions(img)
    # Extract the ext4 partitions (sparse) so e2fsck/debugfs can read them.
    files = {}
    for name, p in zip(("boot", "root", "data"), parts):
        f = d / f"{name}.part"
        with open(img, "rb") as src, open(f, "wb") as dst:
            src.seek(p["start"] * 512)
            left = p["size"] * 512
            while left:
                chunk = src.read(min(left, 4 * MiB))
                if not chunk:
                    break
                if chunk.count(0) == len(chunk):
                    dst.seek(len(chunk), 1)
                else:
                    dst.write(chunk)
                left -= len(chunk)
            dst.truncate(p["size"] * 512)
        files[name] = f
    return {
        "img": img, "out": out, "work": out / "work-qemu", "parts": parts, "files": files,
        "pubkey": (d / "id_ed25519.pub").read_text().strip(), "config": config_file,
        "log": res.stderr,
    }


def _partitions(img: Path) -> list[dict]:
    table = json.loads(_run(["sfdisk", "--json", img]).stdout)["partitiontable"]
    return table["partitions"]


def _debugfs(part: Path, request: str) -> str:
    return _run(["debugfs", "-R", request, part]).stdout


def _cat(part: Path, path: str) -> str:
    return _debugfs(part, f"cat {path}")


def _stat(part: Path, path: str) -> dict:
    out = _debugfs(part, f"stat {path}")
    m = re.search(r"Mode:\s+0?(\d+)", out)
    u = re.search(r"User:\s+(\d+)\s+Group:\s+(\d+)", out)
    t = re.search(r"Type:\s+(\w+)", out)
    assert m and u and t, f"{path} not found in {part.name}: {out!r}"
    return {"mode": int(m.group(1), 8), "uid": int(u.group(1)), "gid": int(u.group(2)), "type": t.group(1)}


def _mtools(img: Path, parts, *args) -> str:
    off = parts[0]["start"] * 512
    env = dict(os.environ, MTOOLS_SKIP_CHECK="1")
    return _run([args[0], "-i", f"{img}@@{off}", *args[1:]], env=env).stdout


def _passwd(built) -> dict[str, list[str]]:
    text = _cat(built["files"]["root"], "/etc/passwd")
    return {line.split(":")[0]: line.split(":") for line in text.splitlines() if line}


# ----------------------------------------------------------------- script


def test_help_and_bash_syntax():
    _run(["bash", "-n", SCRIPT])
    _run(["bash", "-n", REPO / "systemd" / "appliance-firstboot"])
    res = _run([SCRIPT, "--help"])
    for opt in ("--target", "--wheelhouse", "--models-dir", "--no-models", "--ssh-key", "--password", "--hat"):
        assert opt in res.stdout


def test_unknown_hat_is_rejected():
    res = _run([SCRIPT, "--hat", "no-such-hat"], check=False)
    assert res.returncode != 0 and "unknown --hat" in res.stderr


def _pinned_model_hashes() -> bool:
    text = SCRIPT.read_text()
    return bool(re.search(r'^MODEL_SHA256_PINNED="[0-9a-fA-F]{64}"', text, re.M))


def test_refuses_models_without_pinned_hash(config_file, tmp_path):
    """No model source/hash given: must fail with the reason, not build silently."""
    _require_env()
    if _pinned_model_hashes():
        pytest.skip("the model hashes are pinned in build-image.sh: there is no missing hash to refuse")
    small_root_tar = tmp_path / "unused.tar"  # the check comes before any root is needed
    res = _run(
        [SCRIPT, "--target", "qemu", "--rootfs-tar", small_root_tar, "--arch", _host_arch(),
         "--skip-python", "--config", config_file, "--out", tmp_path / "o", "--cache", tmp_path / "c"],
        check=False, timeout=120,
        env=dict(os.environ, APPLIANCE_MODEL_SHA256="", APPLIANCE_MMPROJ_SHA256=""),
    )
    assert res.returncode != 0
    assert "no pinned SHA-256" in res.stderr and "--no-models" in res.stderr
    assert not list((tmp_path / "o").glob("*.img"))


def test_models_dir_hash_must_match(config_file, tmp_path):
    _require_env()
    small_root_tar = tmp_path / "unused.tar"  # the hash check comes before any root is needed
    models = tmp_path / "models"
    models.mkdir()
    (models / "gemma-4-E2B-it-Q4_K_M.gguf").write_bytes(b"not really a model")
    (models / "mmproj-gemma-4-E2B-it-f16.gguf").write_bytes(b"nor a projector")
    want = hashlib.sha256(b"not really a model").hexdigest()
    base = [SCRIPT, "--target", "qemu", "--rootfs-tar", small_root_tar, "--arch", _host_arch(),
            "--skip-python", "--config", config_file, "--out", tmp_path / "o", "--cache", tmp_path / "c",
            "--models-dir", models]
    # Unconfirmed: the error shows the computed hash so the builder can confirm it.
    res = _run(base, check=False, timeout=120,
               env=dict(os.environ, APPLIANCE_MODEL_SHA256="", APPLIANCE_MMPROJ_SHA256=""))
    assert res.returncode != 0 and want in res.stderr
    # Wrong hash: refused.
    res = _run(base + ["--model-sha256", "0" * 64], check=False, timeout=120)
    assert res.returncode != 0 and "expected " + "0" * 64 in res.stderr


# -------------------------------------------------------------- structure


def test_partition_table(built):
    table = json.loads(_run(["sfdisk", "--json", built["img"]]).stdout)["partitiontable"]
    assert table["label"] == "dos"
    assert table["id"].lower() == "0x" + DISK_SIG
    parts = table["partitions"]
    assert [p["type"] for p in parts] == ["c", "83", "83"]
    assert parts[0].get("bootable") is True
    for p in parts:
        assert (p["start"] * 512) % (8 * MiB) == 0, f"partition not 8 MiB aligned: {p}"
    assert parts[0]["size"] * 512 == 512 * MiB
    dump = _run(["sfdisk", "--dump", built["img"]]).stdout
    assert "label: dos" in dump


def test_boot_partition(built):
    img, parts = built["img"], built["parts"]
    listing = _mtools(img, parts, "mdir", "-b", "::")
    names = {Path(line).name for line in listing.split()}
    for f in ("config.txt", "cmdline.txt", "APPLIANCE-README.txt", "appliance-wifi.txt.example"):
        assert f in names, listing
    # no secrets/defaults shipped on the boot partition
    assert "userconf.txt" not in names and "appliance-wifi.txt" not in names
    cmdline = _mtools(img, parts, "mtype", "::cmdline.txt")
    assert cmdline.count("\n") == 1, "cmdline.txt must be a single line"
    assert f"root=PARTUUID={DISK_SIG}-02" in cmdline and "rootwait" in cmdline
    config = _mtools(img, parts, "mtype", "::config.txt")
    active = [line.strip() for line in config.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "auto_initramfs=1" in active
    # HDMI audio needs both lines and KMS; the headless appliance leaves them off.
    assert "#dtparam=audio=on" in config and "#dtoverlay=vc4-kms-v3d" in config
    assert "dtparam=audio=on" not in active
    # the selected HAT's lines are active, the others stay commented
    assert "dtoverlay=wm8960-soundcard" in active and "dtparam=i2s=on" in active
    assert "dtoverlay=googlevoicehat-soundcard" not in active
    assert "#hat=googlevoicehat: dtoverlay=googlevoicehat-soundcard" in config
    fsck = _run(["fsck.vfat" if shutil.which("fsck.vfat") else "true", "-n", built["files"]["boot"]], check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    with open(built["files"]["boot"], "rb") as f:
        bootsector = f.read(512)
    assert bootsector[82:90] == b"FAT32   ", "boot partition is not FAT32"


def test_ext4_filesystems_clean(built):
    for name in ("root", "data"):
        res = _run(["e2fsck", "-fn", built["files"][name]], check=False)
        assert res.returncode == 0, f"{name}: {res.stdout}{res.stderr}"
    assert "rootfs" in _run(["e2label", built["files"]["root"]]).stdout
    assert "data" in _run(["e2label", built["files"]["data"]]).stdout


def test_units_installed_and_enabled(built):
    root = built["files"]["root"]
    for unit in ("appliance.service", "appliance-firstboot.service"):
        st = _stat(root, f"/etc/systemd/system/{unit}")
        assert (st["mode"] & 0o7777, st["uid"], st["gid"]) == (0o644, 0, 0)
        assert _cat(root, f"/etc/systemd/system/{unit}") == (REPO / "systemd" / unit).read_text()
        link = _stat(root, f"/etc/systemd/system/multi-user.target.wants/{unit}")
        assert link["type"] == "symlink"
    st = _stat(root, "/usr/lib/appliance/firstboot")
    assert (st["mode"] & 0o7777, st["uid"]) == (0o755, 0)
    assert _stat(root, "/opt/appliance/venv/bin/appliance")["mode"] & 0o111


def test_users_and_no_default_password(built):
    root = built["files"]["root"]
    users = _passwd(built)
    assert "appliance" in users and ADMIN in users
    app = users["appliance"]
    assert app[6].endswith("nologin") and int(app[2]) < 1000
    groups = {line.split(":")[0]: line.split(":")[3].split(",") for line in _cat(root, "/etc/group").splitlines() if line}
    for g in ("audio", "gpio"):
        assert "appliance" in groups[g], f"appliance not in {g}"
    shadow = _cat(root, "/etc/shadow")
    for line in shadow.splitlines():
        user, pw = line.split(":")[:2]
        # Every account is locked ('!', '*' or empty-with-!): no default password.
        assert pw.startswith(("!", "*")), f"account {user} has a usable password in the image"
        assert pw != "", f"account {user} has an empty password"
    keys = _cat(root, f"/home/{ADMIN}/.ssh/authorized_keys")
    assert built["pubkey"] in keys
    st = _stat(root, f"/home/{ADMIN}/.ssh/authorized_keys")
    assert st["mode"] & 0o777 == 0o600 and st["uid"] == int(users[ADMIN][2])
    sshd = _cat(root, "/etc/ssh/sshd_config.d/10-appliance.conf")
    assert "PasswordAuthentication no" in sshd and "PermitRootLogin no" in sshd


def test_identity_left_for_first_boot(built):
    root = built["files"]["root"]
    assert _cat(root, "/etc/machine-id").strip() == "uninitialized"
    ls = _debugfs(root, "ls -l /etc/ssh")
    assert "ssh_host_" not in ls, "SSH host keys must be generated per card at first boot"
    assert _cat(root, "/etc/hostname").strip() == HOSTNAME


def test_fstab_and_data_partition(built):
    root, data = built["files"]["root"], built["files"]["data"]
    fstab = _cat(root, "/etc/fstab")
    entries = {f[1]: f for f in (line.split() for line in fstab.splitlines()) if f and not f[0].startswith("#")}
    assert entries["/boot/firmware"][0] == f"PARTUUID={DISK_SIG}-01"
    assert entries["/"][0] == f"PARTUUID={DISK_SIG}-02"
    assert entries["/var/lib/appliance"][0] == f"PARTUUID={DISK_SIG}-03"
    assert "data=journal" in entries["/var/lib/appliance"][3]
    assert entries["/etc/appliance"][0] == "/var/lib/appliance/etc" and "bind" in entries["/etc/appliance"][3]
    # config.yaml in place (the data partition's etc/ is /etc/appliance)
    assert _cat(data, "/etc/config.yaml") == built["config"].read_text()
    st = _stat(data, "/etc/config.yaml")
    assert (st["mode"] & 0o777, st["uid"]) == (0o644, 0)
    app_uid = int(_passwd(built)["appliance"][2])
    st = _stat(data, "/state")
    assert (st["type"], st["mode"] & 0o777, st["uid"]) == ("directory", 0o750, app_uid)
    assert _stat(data, "/models")["type"] == "directory"
    assert "--no-models" in _cat(data, "/models/NO_MODELS.txt")
    assert _cat(root, "/usr/share/appliance/config.yaml.default") == built["config"].read_text()
    info = _cat(root, "/etc/appliance-image/build-info")
    assert "models=none" in info and "target=qemu" in info


def test_genimage_config_written(built):
    cfg = (built["out"] / "appliance-0.0.0-ci-qemu.genimage.cfg").read_text()
    assert 'partition-table-type = "mbr"' in cfg and "align = 8M" in cfg
    assert "use-mke2fs = true" in cfg and '"-F 32"' in cfg
    assert f"disk-signature = 0x{DISK_SIG}" in cfg
    if shutil.which("bmaptool"):
        assert (built["out"] / "appliance-0.0.0-ci-qemu.img.bmap").exists()


def test_systemd_analyze_verify(built):
    rootdir = built["work"] / "rootfs"
    units = ["/etc/systemd/system/appliance.service", "/etc/systemd/system/appliance-firstboot.service"]
    res = _run(["systemd-analyze", "verify", f"--root={rootdir}", *units], check=False)
    ours = [line for line in (res.stdout + res.stderr).splitlines() if "appliance" in line]
    assert not ours, "\n".join(ours)
    assert res.returncode == 0, res.stdout + res.stderr


def test_systemd_analyze_security_score():
    res = _run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                REPO / "systemd" / "appliance.service"], check=False)
    m = re.search(r"Overall exposure level for appliance\.service:\s+([\d.]+)", res.stdout + res.stderr)
    assert m, res.stdout + res.stderr
    score = float(m.group(1))
    print(f"\nsystemd-analyze security appliance.service: exposure {score}")
    assert score <= 2.0


def test_firstboot_applies_boot_partition_files(built, tmp_path):
    """Run the first-boot script in a copy of the built root (chroot, host
    architecture): userconf.txt, authorized_keys and appliance-wifi.txt are
    applied and deleted; host keys are generated."""
    root = tmp_path / "root"
    _run(["cp", "-a", built["work"] / "rootfs", root])
    boot = root / "boot" / "firmware"
    boot.mkdir(parents=True, exist_ok=True)
    # openssl passwd -6 -salt salt test1234
    pw_hash = "$6$salt$omHbK1V1Alwa0VKXqLaW38vdS1uUhfx8GTj7XXCJcNUJxABwmYe8Vhpyt2tnnaAFC6UTI7PNk9sTtSGWGnYop."
    (boot / "userconf.txt").write_text(f"maker:{pw_hash}\n")
    (boot / "authorized_keys").write_text(built["pubkey"] + "\r\n")
    (boot / "appliance-wifi.txt").write_text("# home\nssid=My Net\npsk=secret pass\ncountry=GB\n")
    (root / "etc" / "ssh" / "sshd_config.d").mkdir(parents=True, exist_ok=True)
    res = _run(["chroot", root, "/usr/lib/appliance/firstboot"], check=False, timeout=120)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    shadow = (root / "etc" / "shadow").read_text()
    assert f"maker:{pw_hash}:" in shadow, log
    groups = (root / "etc" / "group").read_text()
    assert any(line.startswith("sudo:") and "maker" in line for line in groups.splitlines()) or "sudo:" not in groups
    assert (root / "etc" / "appliance-image" / "admin-user").read_text().strip() == "maker"
    for f in ("userconf.txt", "authorized_keys", "appliance-wifi.txt"):
        assert not (boot / f).exists(), f"{f} (a secret) was not removed"
    keys = (root / "home" / "maker" / ".ssh" / "authorized_keys").read_text()
    assert built["pubkey"] in keys and "\r" not in keys
    assert "PasswordAuthentication no" in (root / "etc/ssh/sshd_config.d/20-appliance-keys-only.conf").read_text()
    conn = root / "etc/NetworkManager/system-connections/appliance-wifi.nmconnection"
    assert conn.stat().st_mode & 0o777 == 0o600
    text = conn.read_text()
    assert "ssid=My Net" in text and "psk=secret pass" in text and "key-mgmt=wpa-psk" in text
    assert list((root / "etc" / "ssh").glob("ssh_host_*_key")), "host keys not generated: " + log


def _firstboot_root(built, tmp_path) -> Path:
    root = tmp_path / "root"
    _run(["cp", "-a", built["work"] / "rootfs", root])
    (root / "boot" / "firmware").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "ssh" / "sshd_config.d").mkdir(parents=True, exist_ok=True)
    return root


def _firstboot(root) -> subprocess.CompletedProcess:
    res = _run(["chroot", root, "/usr/lib/appliance/firstboot"], check=False, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    return res


PW_HASH = "$6$salt$omHbK1V1Alwa0VKXqLaW38vdS1uUhfx8GTj7XXCJcNUJxABwmYe8Vhpyt2tnnaAFC6UTI7PNk9sTtSGWGnYop."


def test_firstboot_provisions_once(built, tmp_path):
    """First boot applies the boot-partition files and leaves a marker; on a
    later boot the same files are not applied, only deleted, with a line on
    the console (the unit's StandardOutput=journal+console)."""
    root = _firstboot_root(built, tmp_path)
    boot = root / "boot" / "firmware"
    (boot / "userconf.txt").write_text(f"maker:{PW_HASH}\n")
    _firstboot(root)
    marker = root / "var/lib/appliance-firstboot/provisioned"
    assert marker.exists() and re.match(r"\d{4}-\d\d-\d\dT", marker.read_text())
    # Second boot: somebody with the card in a reader tries again.
    (boot / "userconf.txt").write_text(f"intruder:{PW_HASH}\n")
    (boot / "authorized_keys").write_text(built["pubkey"].replace("ci@test", "intruder") + "\n")
    (boot / "appliance-wifi.txt").write_text("ssid=Evil\npsk=12345678\n")
    res = _firstboot(root)
    assert "intruder" not in (root / "etc/passwd").read_text()
    keys = (root / "home" / "maker" / ".ssh" / "authorized_keys")
    assert not keys.exists() or "intruder" not in keys.read_text()
    assert not (root / "etc/NetworkManager/system-connections/appliance-wifi.nmconnection").exists()
    for f in ("userconf.txt", "authorized_keys", "appliance-wifi.txt"):
        assert not (boot / f).exists()
    lines = [ln for ln in res.stderr.splitlines() if "ignored and deleted" in ln]
    assert len(lines) == 1 and "ran on the first boot" in lines[0], res.stderr


def test_firstboot_keeps_provisioning_open_until_someone_can_log_in(built, tmp_path):
    root = _firstboot_root(built, tmp_path)
    (root / "home" / ADMIN / ".ssh" / "authorized_keys").unlink()
    res = _firstboot(root)
    assert "no login is configured" in res.stderr
    assert not (root / "var/lib/appliance-firstboot/provisioned").exists()
    (root / "boot/firmware/authorized_keys").write_text(built["pubkey"] + "\n")
    res = _firstboot(root)
    assert built["pubkey"] in (root / "home" / ADMIN / ".ssh" / "authorized_keys").read_text()
    assert (root / "var/lib/appliance-firstboot/provisioned").exists()
    assert "no login is configured" not in res.stderr


@pytest.mark.parametrize("user,why", [
    ("daemon", "is a system account (UID 1)"),
    ("nobody", "is a system account (UID 65534)"),
    ("sudo", "is a system group"),
    ("root", "is reserved"),
    ("appliance", "is reserved"),
    ("Bad.Name", "is not a valid user name"),
    ("a" * 33, "is not a valid user name"),
])
def test_firstboot_refuses_system_and_invalid_user_names(built, tmp_path, user, why):
    root = _firstboot_root(built, tmp_path)
    passwd_before = (root / "etc/passwd").read_text()
    shadow_before = (root / "etc/shadow").read_text()
    (root / "boot/firmware/userconf.txt").write_text(f"{user}:{PW_HASH}\n")
    res = _firstboot(root)
    assert (root / "etc/passwd").read_text() == passwd_before
    assert (root / "etc/shadow").read_text() == shadow_before, "a system account got a password"
    line = [ln for ln in res.stderr.splitlines() if "userconf.txt" in ln]
    assert len(line) == 1 and why in line[0] and "ignored" in line[0], res.stderr
    assert not (root / "boot/firmware/userconf.txt").exists()


def _glib_unescape(value: str) -> str:
    """GLib key-file string unescaping (g_key_file_parse_value_as_string),
    what NetworkManager applies to psk=."""
    out, i = [], 0
    while i < len(value):
        c = value[i]
        if c == "\\" and i + 1 < len(value):
            out.append({"s": " ", "n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[value[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def test_firstboot_escapes_wifi_values(built, tmp_path):
    root = _firstboot_root(built, tmp_path)
    psk = "  back\\slash;pass  "
    ssid = " Café;Net\\ "
    (root / "boot/firmware/appliance-wifi.txt").write_text(f"ssid={ssid}\npsk={psk}\ncountry=de\n", encoding="utf-8")
    _firstboot(root)
    text = (root / "etc/NetworkManager/system-connections/appliance-wifi.nmconnection").read_text()
    values = dict(ln.split("=", 1) for ln in text.splitlines() if "=" in ln)
    assert _glib_unescape(values["psk"]) == psk, values["psk"]
    # The SSID has ";", "\\" and edge spaces: written as NetworkManager's byte list.
    assert bytes(int(b) for b in values["ssid"].rstrip(";").split(";")) == ssid.encode()
    assert (root / "etc/modprobe.d/appliance-wifi-country.conf").read_text() == "options cfg80211 ieee80211_regdom=DE\n"
    if shutil.which("/usr/bin/python3"):
        # Where GLib itself is at hand, read the file the way NetworkManager does.
        probe = ("import sys\ntry:\n from gi.repository import GLib\nexcept ImportError:\n sys.exit(3)\n"
                 "k=GLib.KeyFile(); d=open(sys.argv[1]).read(); k.load_from_data(d, len(d.encode()), 0)\n"
                 "print(k.get_string('wifi-security','psk'), end='')")
        r = subprocess.run(["/usr/bin/python3", "-c", probe, str(root / "etc/NetworkManager/system-connections/appliance-wifi.nmconnection")],
                           capture_output=True, text=True)
        if r.returncode != 3:
            assert r.returncode == 0 and r.stdout == psk, r.stderr


@pytest.mark.parametrize("content,why", [
    ("ssid=Home\npsk=12345678\ncountry=XX\n", "country=XX is not an ISO 3166 country code"),
    ("ssid=Home\npsk=12345678\ncountry=GB ieee80211_regdom=US\n", "is not a two-letter ISO 3166"),
    ("ssid=Home\npsk=short\n", "psk must be 8 to 63 printable ASCII"),
    ("ssid=Home\npsk=pass\x01word99\n", "control characters"),
    ("ssid=Home\npsk=12345678\nhidden=maybe\n", "hidden= must be true or false"),
    ("psk=12345678\n", "no ssid= line"),
    ("ssid=" + "x" * 33 + "\npsk=12345678\n", "at most 32"),
])
def test_firstboot_refuses_bad_wifi_values(built, tmp_path, content, why):
    root = _firstboot_root(built, tmp_path)
    (root / "boot/firmware/appliance-wifi.txt").write_text(content)
    res = _firstboot(root)
    assert not (root / "etc/NetworkManager/system-connections/appliance-wifi.nmconnection").exists()
    assert not (root / "etc/modprobe.d/appliance-wifi-country.conf").exists()
    line = [ln for ln in res.stderr.splitlines() if "appliance-wifi.txt" in ln]
    assert len(line) == 1 and why in line[0] and "ignored" in line[0], res.stderr


def test_build_refuses_bad_wifi_file(config_file, tmp_path):
    f = tmp_path / "wifi.txt"
    f.write_text("ssid=Home\npsk=12345678\ncountry=XX\n")
    res = _run([SCRIPT, "--target", "qemu", "--wifi-file", f, "--config", config_file], check=False, timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "--wifi-file" in res.stderr and "country=XX" in res.stderr


def test_key_only_owner_may_edit_config_and_reload(built, tmp_path):
    """Image built with --ssh-key only: the admin has no password, yet sudo
    allows exactly the config edit and the service commands, nothing else."""
    root = built["work"] / "rootfs"
    shadow = {ln.split(":")[0]: ln.split(":")[1] for ln in _cat(built["files"]["root"], "/etc/shadow").splitlines()}
    assert shadow[ADMIN].startswith("!"), "the test image is key-only"
    st = _stat(built["files"]["root"], "/etc/sudoers.d/appliance-owner")
    assert (st["mode"] & 0o777, st["uid"]) == (0o440, 0)
    if not (root / "usr/bin/sudo").exists():
        pytest.skip("no sudo in the small test root")
    res = _run(["chroot", root, "visudo", "-c", "-f", "/etc/sudoers.d/appliance-owner"], check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    # Run the commands as the admin, non-interactively (sudo -n: fail rather
    # than ask for the password the admin does not have). A copy of the root.
    root = tmp_path / "root"
    _run(["cp", "-a", built["work"] / "rootfs", root])
    (root / "etc/appliance/config.yaml").write_text(built["config"].read_text())
    editor = root / "usr/local/bin/owner-edit"
    editor.write_text('#!/bin/sh\necho "# edited by the owner" >>"$1"\n')
    editor.chmod(0o755)

    def as_admin(*cmd):
        return _run(["chroot", root, "sudo", "-u", ADMIN, "env", "SUDO_EDITOR=/usr/local/bin/owner-edit",
                     "sudo", "-n", *cmd], check=False, timeout=60)

    def refused(r) -> bool:
        return r.returncode != 0 and ("a password is required" in r.stderr or "not allowed" in r.stderr)

    r = as_admin("-e", "/etc/appliance/config.yaml")  # sudo -e = sudoedit
    assert r.returncode == 0, r.stderr
    assert (root / "etc/appliance/config.yaml").read_text().endswith("# edited by the owner\n")
    # systemctl itself cannot talk to systemd in a chroot; sudo let it run.
    for cmd in (["systemctl", "reload", "appliance"], ["systemctl", "restart", "appliance.service"]):
        r = as_admin(*cmd)
        assert not refused(r), (cmd, r.stderr)
    for cmd in (["systemctl", "stop", "ssh"], ["sudoedit", "/etc/shadow"], ["bash"],
                ["systemctl", "reload", "appliance", "ssh"], ["cat", "/etc/shadow"]):
        r = as_admin(*cmd)
        assert refused(r), (cmd, r.returncode, r.stderr)


def test_firewall_allows_ssh_and_mdns_only(built):
    root = built["files"]["root"]
    conf = _cat(root, "/etc/nftables.conf")
    assert "policy drop" in conf
    accepts = [ln.strip() for ln in conf.splitlines() if ln.strip().endswith("accept") or "accept comment" in ln]
    ports = sorted(re.findall(r"dport (\d+) accept", conf))
    assert ports == ["22", "5353", "546", "68"], ports
    assert any("tcp dport 22" in a for a in accepts) and any("udp dport 5353" in a for a in accepts)
    link = _stat(root, "/etc/systemd/system/sysinit.target.wants/nftables.service")
    assert link["type"] == "symlink"
    if shutil.which("nft"):
        res = _run(["nft", "-c", "-f", REPO / "systemd" / "nftables.conf"], check=False)
        assert res.returncode == 0, res.stderr


def test_systemd_analyze_security_firstboot():
    res = _run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                REPO / "systemd" / "appliance-firstboot.service"], check=False)
    m = re.search(r"Overall exposure level for appliance-firstboot\.service:\s+([\d.]+)", res.stdout + res.stderr)
    assert m, res.stdout + res.stderr
    print(f"\nsystemd-analyze security appliance-firstboot.service: exposure {m.group(1)} (was 9.5)")
    assert float(m.group(1)) <= 3.0


def test_firstboot_warns_when_nobody_can_log_in(built, tmp_path):
    root = tmp_path / "root"
    _run(["cp", "-a", built["work"] / "rootfs", root])
    ak = root / "home" / ADMIN / ".ssh" / "authorized_keys"
    ak.unlink()
    res = _run(["chroot", root, "/usr/lib/appliance/firstboot"], check=False, timeout=120)
    assert res.returncode == 0
    assert "no login is configured" in res.stderr


# ------------------------------------------------------------- Pi 5 target
# build-image.sh --target pi5 on the small root plus a fake kernel package
# (tests/pi5_fakes.py: the Raspberry Pi archive is unreachable and a real
# Debian kernel root takes half an hour under emulation). This runs the
# script's Pi 5 steps -- pi5_boot_files, our kernel/initramfs hooks for
# --pi5-kernel debian, config.txt/cmdline.txt per kernel -- and the boot
# checker it runs on every finished Pi 5 image. `make test-image-pi5` builds
# the real one.

import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pi5_fakes  # noqa: E402


def _pi5_root_tar(small_root_tar: Path, d: Path, kind: str, hat_overlays=(), drop: str | None = None) -> Path:
    fake = d / f"fake-{kind}"
    pi5_fakes.root_files(fake, kind, hat_overlays)
    if drop:
        for p in fake.rglob(drop):
            p.unlink()
    tar = d / f"root-{kind}.tar"
    shutil.copyfile(small_root_tar, tar)
    _run(["tar", "--append", "--owner=0", "--group=0", "-f", tar, "-C", fake, "./usr", "./boot"])
    return tar


def _build_pi5(small_root_tar, config_file, d: Path, kind: str, hat="none", drop=None, extra=()):
    tar = _pi5_root_tar(small_root_tar, d, kind, ("wm8960-soundcard",) if hat != "none" else (), drop)
    out = d / "out"
    cmd = [SCRIPT, "--target", "pi5", "--pi5-kernel", kind, "--rootfs-tar", tar, "--arch", _host_arch(),
           "--skip-python", "--no-models", "--config", config_file, "--hat", hat,
           "--version", "0.0.0-ci", "--out", out, "--root-size", "1G", "--disk-signature", DISK_SIG,
           "--no-compress", "--keep-work", "--cache", d / "cache", *extra]
    res = _run(cmd, check=False, timeout=600)
    suffix = "-debian-kernel" if kind == "debian" else ""
    return res, out / f"appliance-0.0.0-ci{suffix}.img"


@pytest.fixture(scope="session")
def pi5_debian(small_root_tar, config_file, tmp_path_factory):
    d = tmp_path_factory.mktemp("pi5deb")
    res, img = _build_pi5(small_root_tar, config_file, d, "debian")
    if res.returncode != 0:
        pytest.fail(f"build-image.sh --target pi5 --pi5-kernel debian failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return {"img": img, "log": res.stderr, "root": d / "out" / "work-pi5" / "rootfs", "parts": _partitions(img)}


def test_pi5_debian_kernel_build_passes_the_boot_check(pi5_debian):
    log = pi5_debian["log"]
    # The checker ran at the end of the build, on the finished image.
    assert "checking the Pi 5 boot partition" in log
    assert "check-pi5-boot: all 9 checks passed" in log, log[-3000:]
    for name in ("kernel", "kconfig", "initramfs", "dtb", "devicetree", "cmdline.txt"):
        assert re.search(rf"^PASS {re.escape(name)}:", log, re.M), name
    assert "bcm2712-d-rpi-5-b.dtb (mainline D0 device tree)" in log
    # And it passes when run again on its own (what make test-image-pi5 does).
    res = _run([sys.executable, REPO / "tools" / "check-pi5-boot", pi5_debian["img"]], check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_pi5_debian_kernel_boot_partition(pi5_debian):
    img, parts = pi5_debian["img"], pi5_debian["parts"]
    names = {Path(line).name for line in _mtools(img, parts, "mdir", "-b", "::").split()}
    for f in ("kernel_2712.img", "initramfs_2712", "bcm2712-rpi-5-b.dtb", "bcm2712-d-rpi-5-b.dtb",
              "appliance-kernel.txt", "config.txt", "cmdline.txt"):
        assert f in names, sorted(names)
    assert "overlays" not in names  # nothing from the Raspberry Pi kernel
    config = _mtools(img, parts, "mtype", "::config.txt")
    active = [ln.strip() for ln in config.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert "upstream_kernel=1" in active
    assert not any(ln.startswith("dtoverlay=") for ln in active)
    cmdline = _mtools(img, parts, "mtype", "::cmdline.txt")
    assert "console=ttyAMA10,115200" in cmdline and "serial0" not in cmdline
    assert _mtools(img, parts, "mtype", "::appliance-kernel.txt").strip() == pi5_fakes.DEBIAN_KVER


def test_pi5_debian_kernel_root(pi5_debian):
    root = pi5_debian["root"]
    rules = (root / "etc/udev/rules.d/60-appliance-gpio.rules").read_text()
    assert 'KERNEL=="gpiochip*", GROUP="gpio", MODE="0660"' in rules
    assert 'ATTR{label}=="pinctrl-rp1", SYMLINK+="gpiochip4"' in rules
    for hook in ("etc/kernel/postinst.d/zz-appliance-pi5-boot", "etc/initramfs/post-update.d/zz-appliance-pi5-boot",
                 "etc/initramfs-tools/hooks/appliance-pi5"):
        assert os.access(root / hook, os.X_OK), hook
    prefs = (root / "etc/apt/preferences.d/appliance-kernel-backports").read_text()
    assert "Pin: release n=trixie-backports" in prefs and "Pin-Priority: 990" in prefs
    assert not (root / "etc/apt/sources.list.d/raspi.sources").exists()
    assert "pi5_kernel=debian" in (root / "etc/appliance-image/build-info").read_text()


def test_pi5_debian_kernel_update_keeps_config_txt(pi5_debian, tmp_path):
    """A kernel update runs our hook: the kernel, initramfs and device trees
    on /boot/firmware are replaced, config.txt and cmdline.txt are not."""
    root = tmp_path / "root"
    _run(["cp", "-a", pi5_debian["root"], root])
    fw = root / "boot" / "firmware"
    fw.mkdir(parents=True, exist_ok=True)
    (fw / "config.txt").write_text("# the appliance's lines\ndtparam=i2s=on\n")
    (fw / "cmdline.txt").write_text("console=ttyAMA10,115200 root=PARTUUID=a1b2c3d4-02 rootwait\n")
    before = {f: (fw / f).read_text() for f in ("config.txt", "cmdline.txt")}
    # A newer kernel version arrives (same fake files, new version string).
    new = "7.3.9+deb13-arm64"
    mod = root / "usr/lib/modules" / new
    shutil.copytree(root / "usr/lib/modules" / pi5_fakes.DEBIAN_KVER, mod, symlinks=True)
    (mod / "vmlinuz").write_bytes(pi5_fakes.arm64_image(new))
    (root / "usr/lib" / f"linux-image-{new}").symlink_to(f"modules/{new}/dtb")
    (root / "boot" / f"initrd.img-{new}").write_bytes(pi5_fakes.initramfs(new, pi5_fakes.DEBIAN_MODULES))
    r1 = _run(["chroot", root, "/etc/kernel/postinst.d/zz-appliance-pi5-boot", new, f"/boot/vmlinuz-{new}"])
    r2 = _run(["chroot", root, "/etc/initramfs/post-update.d/zz-appliance-pi5-boot", new, f"/boot/initrd.img-{new}"])
    assert f"Linux version {new}".encode() in (fw / "kernel_2712.img").read_bytes(), r1.stdout + r1.stderr
    assert (fw / "initramfs_2712").read_bytes() == (root / "boot" / f"initrd.img-{new}").read_bytes(), r2.stdout
    assert (fw / "appliance-kernel.txt").read_text().strip() == new
    assert {f: (fw / f).read_text() for f in ("config.txt", "cmdline.txt")} == before
    # An older kernel's hook run (apt removing it) leaves the partition alone.
    r3 = _run(["chroot", root, "/etc/kernel/postinst.d/zz-appliance-pi5-boot", pi5_fakes.DEBIAN_KVER])
    assert "not the newest kernel" in r3.stdout
    assert f"Linux version {new}".encode() in (fw / "kernel_2712.img").read_bytes()


def test_pi5_rpi_kernel_build_with_hat(small_root_tar, config_file, tmp_path):
    res, img = _build_pi5(small_root_tar, config_file, tmp_path, "rpi", hat=HAT)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "check-pi5-boot: all 9 checks passed" in res.stderr
    assert "PASS overlays: 1 dtoverlay= line(s), each with its .dtbo" in res.stderr
    parts = _partitions(img)
    listing = _mtools(img, parts, "mdir", "-b", "::/overlays")
    assert "bcm2712d0.dtbo" in listing and "overlay_map.dtb" in listing
    config = _mtools(img, parts, "mtype", "::config.txt")
    active = [ln.strip() for ln in config.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert "upstream_kernel=1" not in active and "dtoverlay=wm8960-soundcard" in active
    assert "console=serial0,115200" in _mtools(img, parts, "mtype", "::cmdline.txt")


@pytest.mark.parametrize("kind,drop,missing", [
    ("debian", "bcm2712-d-rpi-5-b.dtb", "bcm2712-d-rpi-5-b.dtb"),
    ("rpi", "bcm2712d0.dtbo", "overlays/bcm2712d0.dtbo"),
    ("rpi", "overlay_map.dtb", "overlays/overlay_map.dtb"),
])
def test_pi5_build_refuses_a_kernel_without_the_d0_files(small_root_tar, config_file, tmp_path, kind, drop, missing):
    res, img = _build_pi5(small_root_tar, config_file, tmp_path, kind, drop=drop)
    assert res.returncode != 0
    assert f"boot partition lacks {missing}" in res.stderr, res.stderr[-2000:]
    assert not img.exists()


def test_pi5_build_refuses_a_failing_boot_check(small_root_tar, config_file, tmp_path):
    """The kernel package lacks the SD driver in its config: the image is
    built, the checker fails it, and the build says not to flash it."""
    d = tmp_path
    fake = d / "fake"
    pi5_fakes.root_files(fake, "debian")
    cfg = fake / "usr/lib/modules" / pi5_fakes.DEBIAN_KVER / "config"
    cfg.write_text(cfg.read_text().replace("CONFIG_MMC_SDHCI_BRCMSTB=m", "# CONFIG_MMC_SDHCI_BRCMSTB is not set"))
    tar = d / "root.tar"
    shutil.copyfile(small_root_tar, tar)
    _run(["tar", "--append", "--owner=0", "--group=0", "-f", tar, "-C", fake, "./usr", "./boot"])
    res = _run([SCRIPT, "--target", "pi5", "--pi5-kernel", "debian", "--rootfs-tar", tar, "--arch", _host_arch(),
                "--skip-python", "--no-models", "--config", config_file, "--version", "0.0.0-ci",
                "--out", d / "out", "--root-size", "1G", "--no-compress", "--cache", d / "cache"],
               check=False, timeout=600)
    assert res.returncode == 1
    assert "FAIL kconfig" in res.stderr and "CONFIG_MMC_SDHCI_BRCMSTB" in res.stderr
    assert "the Pi 5 boot check failed" in res.stderr and "do not flash" in res.stderr


@pytest.mark.parametrize("args,words", [
    (["--target", "pi5", "--pi5-kernel", "debian", "--hat", HAT], "--hat respeaker-2mic-v1 needs the Raspberry Pi kernel"),
    (["--pi5-kernel", "mainline"], "--pi5-kernel must be rpi or debian"),
    (["--user", "daemon"], "--user may not be 'daemon'"),
    (["--user", "Bad.Name"], "invalid --user 'Bad.Name'"),
    (["--ssh-key", "/nonexistent.pub"], "--ssh-key /nonexistent.pub: file not found"),
])
def test_bad_options_one_line_exit_2(args, words):
    res = _run([SCRIPT, *args], check=False, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and words in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_missing_tools_are_all_named_before_any_step(tmp_path):
    """PATH without arch-test, qemu-img-era tools etc.: one line names every
    missing tool and its package, before anything is built or downloaded."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "dirname", "dpkg", "grep", "sed", "awk", "id", "tr", "sort", "cat", "env", "head", "git"):
        p = shutil.which(tool)
        if p:
            (bindir / tool).symlink_to(p)
    res = _run([SCRIPT, "--target", "pi5", "--pi5-kernel", "debian", "--no-models", "--out", tmp_path / "o",
                "--cache", tmp_path / "c"], check=False, timeout=60, env={"PATH": str(bindir), "HOME": str(tmp_path)})
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert line.count("\n") == 0, line
    for tool, pkg in (("mmdebstrap", "mmdebstrap"), ("genimage", "genimage"), ("arch-test", "arch-test"),
                      ("qemu-aarch64-static", "qemu-user-static"), ("dtc", "device-tree-compiler"),
                      ("lsinitramfs", "initramfs-tools-core")):
        if _host_arch() == "arm64" and tool in ("arch-test", "qemu-aarch64-static"):
            continue
        assert tool in line and pkg in line, line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
