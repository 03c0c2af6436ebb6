use kivi_spec::Invalid;

/// Everything that can go wrong in the runtime. Each variant names the
/// offending value; none of them leaves a cache half-updated.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid scheme: {0}")]
    Scheme(#[from] Invalid),
    #[error("scheme `{0}` has no head layout or head_dim; bind one with Scheme::with_shape")]
    Unbound(String),
    #[error("{what}: expected {expected}, got {got}")]
    Shape {
        what: &'static str,
        expected: String,
        got: String,
    },
    #[error("non-finite {tensor} value ({value}) at token {token}, head {head}, channel {channel}; the {policy} policy refuses it")]
    NonFinite {
        tensor: &'static str,
        value: f32,
        token: usize,
        head: usize,
        channel: usize,
        policy: &'static str,
    },
    #[error("{tensor} values near token {token}, kv head {head}, channel {channel} span [{lo}, {hi}], which a {dtype} scale or zero point cannot hold; use scale = f32")]
    ScaleOverflow {
        tensor: &'static str,
        token: usize,
        head: usize,
        channel: usize,
        lo: f32,
        hi: f32,
        dtype: &'static str,
    },
    #[error("{tensor} {value} at token {token}, kv head {head}, channel {channel} is outside ±{limit}, the widest range that {bits}-bit groups with {dtype} scales can always hold; use scale = f32 or scale the input down")]
    OutOfRange {
        tensor: &'static str,
        value: f32,
        token: usize,
        head: usize,
        channel: usize,
        limit: f32,
        bits: u32,
        dtype: &'static str,
    },
    #[error("{tensor} outlier at token {token}, kv head {head}, channel {channel} needs a correction of {value}, which {dtype} cannot hold; use dtype f32")]
    OutlierOverflow {
        tensor: &'static str,
        token: usize,
        head: usize,
        channel: usize,
        value: f32,
        dtype: &'static str,
    },
    #[error("out of cache blocks: the append needs {need} more, {free} of {total} are free")]
    OutOfBlocks { need: usize, free: usize, total: usize },
    /// A shared [`crate::pool::BlockPool`] has too few bytes left for the
    /// blocks an append needs; nothing was written or charged.
    #[error("block pool exhausted: the append needs {blocks} more blocks ({need} bytes), {free} of the pool's {capacity} bytes are free; give the pool a larger capacity, evict (sliding windows) or free sequences")]
    PoolExhausted {
        blocks: usize,
        need: usize,
        free: usize,
        capacity: usize,
    },
    /// Attention that would read tokens an eviction window freed.
    #[error("sequence {seq}: attention from token {start} reads evicted tokens (held from token {first_held} on, eviction window {window:?}); attend with a sliding window no wider than the eviction window")]
    Evicted {
        seq: u64,
        start: usize,
        first_held: usize,
        window: Option<usize>,
    },
    #[error("unknown sequence id {0}")]
    UnknownSequence(u64),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{backend}: compiling `{kernel}` failed:\n{log}")]
    Compile {
        backend: &'static str,
        kernel: String,
        log: String,
    },
    /// An error about one sequence of a batch.
    #[error("sequence {seq}: {source}")]
    InSequence { seq: usize, source: Box<Error> },
    /// A missing, damaged or mismatched calibration (boxed: its messages
    /// carry several names, and every `Result` of the runtime carries this).
    #[error(transparent)]
    Calibration(Box<crate::calib::CalibError>),
    #[error("the {backend} backend is unavailable: {reason}")]
    Unavailable { backend: &'static str, reason: String },
}

impl From<crate::calib::CalibError> for Error {
    fn from(e: crate::calib::CalibError) -> Error {
        Error::Calibration(Box::new(e))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
