//! Copying a rank's output, line by line, with a `[rank] ` prefix.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::Mutex;

/// Longest line kept in memory: a longer one is written in pieces of this
/// size, each ended with a newline (a rank writing megabytes without a newline
/// must not make braid-run grow without bound).
pub(crate) const MAX_LINE: usize = 1 << 20;

/// The prefix for `rank`'s lines (`"[3] "`), or nothing.
pub(crate) fn prefix_for(rank: usize, enabled: bool) -> Vec<u8> {
    if enabled {
        format!("[{rank}] ").into_bytes()
    } else {
        Vec::new()
    }
}

/// `prefix` + `line` + a newline if `line` lacks one: the bytes written for
/// one line, in one piece.
pub(crate) fn format_line(prefix: &[u8], line: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + line.len() + 1);
    out.extend_from_slice(prefix);
    out.extend_from_slice(line);
    if line.last() != Some(&b'\n') {
        out.push(b'\n');
    }
    out
}

/// Reads `input` to its end and writes each line, prefixed, to `out` with a
/// single `write_all` while holding the lock, so lines of different ranks
/// never mix. A last line without newline is written with one added. If `out`
/// fails (e.g. a closed pipe), the rest of `input` is still read and dropped so
/// that the rank never blocks on a full pipe. Returns the first read error.
pub(crate) fn pump<R: Read, W: Write>(
    input: R,
    prefix: &[u8],
    out: &Mutex<W>,
    max_line: usize,
) -> io::Result<()> {
    let max_line = max_line.max(1);
    let mut reader = BufReader::new(input);
    let mut line: Vec<u8> = Vec::new();
    let mut out_ok = true;
    loop {
        let (consumed, eof) = {
            let buf = match reader.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if buf.is_empty() {
                (0, true)
            } else {
                let room = max_line - line.len();
                let take = match buf.iter().take(room).position(|&b| b == b'\n') {
                    Some(i) => i + 1,
                    None => buf.len().min(room),
                };
                line.extend_from_slice(&buf[..take]);
                (take, false)
            }
        };
        reader.consume(consumed);
        let complete = line.last() == Some(&b'\n') || line.len() >= max_line;
        if (complete || eof) && !line.is_empty() {
            if out_ok {
                let bytes = format_line(prefix, &line);
                // A poisoned lock only means another reader panicked while
                // writing; the writer itself is still usable.
                let mut w = out.lock().unwrap_or_else(|p| p.into_inner());
                out_ok = w.write_all(&bytes).and_then(|()| w.flush()).is_ok();
            }
            line.clear();
        }
        if eof {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(input: &[u8], prefix: &str, max_line: usize) -> Vec<u8> {
        let out = Mutex::new(Vec::new());
        pump(input, prefix.as_bytes(), &out, max_line).expect("pump");
        out.into_inner().expect("lock")
    }

    #[test]
    fn prefixes() {
        assert_eq!(prefix_for(0, true), b"[0] ");
        assert_eq!(prefix_for(12, true), b"[12] ");
        assert_eq!(prefix_for(12, false), b"");
        assert_eq!(format_line(b"[1] ", b"x\n"), b"[1] x\n");
        assert_eq!(format_line(b"[1] ", b"x"), b"[1] x\n");
        assert_eq!(format_line(b"", b""), b"\n");
    }

    #[test]
    fn lines_are_prefixed() {
        assert_eq!(
            run(b"a\nbb\n\nc", "[3] ", MAX_LINE),
            b"[3] a\n[3] bb\n[3] \n[3] c\n"
        );
        assert_eq!(run(b"", "[3] ", MAX_LINE), b"");
        assert_eq!(run(b"x\n", "", MAX_LINE), b"x\n");
        // Non-UTF-8 bytes pass through untouched.
        assert_eq!(run(b"\xff\xfe\n", "[0] ", MAX_LINE), b"[0] \xff\xfe\n");
    }

    #[test]
    fn long_lines_are_split() {
        assert_eq!(run(b"abcdefg\nhi\n", "> ", 3), b"> abc\n> def\n> g\n> hi\n");
        assert_eq!(run(b"abc\n", "> ", 3), b"> abc\n> \n");
    }

    #[test]
    fn small_reads_still_give_whole_lines() {
        // A reader that returns one byte at a time.
        struct OneByte<'a>(&'a [u8]);
        impl Read for OneByte<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0.is_empty() || buf.is_empty() {
                    return Ok(0);
                }
                buf[0] = self.0[0];
                self.0 = &self.0[1..];
                Ok(1)
            }
        }
        let out = Mutex::new(Vec::new());
        pump(OneByte(b"hello\nworld"), b"[1] ", &out, MAX_LINE).expect("pump");
        assert_eq!(out.into_inner().expect("lock"), b"[1] hello\n[1] world\n");
    }

    #[test]
    fn write_errors_keep_draining() {
        struct Broken;
        impl Write for Broken {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::Error::from(io::ErrorKind::BrokenPipe))
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut input: &[u8] = b"a\nb\nc\n";
        let out = Mutex::new(Broken);
        pump(&mut input, b"", &out, MAX_LINE).expect("pump");
        assert!(input.is_empty(), "input not drained");
    }
}
