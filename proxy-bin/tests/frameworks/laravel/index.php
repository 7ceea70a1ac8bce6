<?php
// A faithful stand-in for the Laravel seed's ContactRequestController, in
// plain PHP (Laravel itself cannot be installed here), for the proxy's tests.
// It answers the way Laravel does:
//   * every response sets the session cookie (and XSRF-TOKEN) again;
//   * POST /contact checks the CSRF `_token` against the session (419 if
//     wrong), then `validate()`: on failure a 302 BACK to the previous page
//     (an absolute URL, as Laravel's redirector writes it) with the errors
//     and the old input flashed into the session; on success the record is
//     created and a notification "dispatched", then a 302 to the absolute
//     URL of the thanks route (`to_route('contact.thanks')`).
// Unlike the seed, the table has NO unique index on submission_token: behind
// idempotency-proxy the proxy alone must hold the guarantee.
//
// Run: DATA_DIR=/tmp/x php -S 127.0.0.1:PORT index.php (SUBMIT_DELAY_MS: how
// long an accepted submission takes, default 20).
// GET /_stats answers the counts as JSON (tests only).

$dataDir = getenv('DATA_DIR') ?: sys_get_temp_dir();
$recordsFile = $dataDir . '/records.jsonl';
$notificationsFile = $dataDir . '/notifications.log';

session_save_path($dataDir);
session_name('laravel_session');
ini_set('session.use_strict_mode', '1');
// The cookie is read and written here, once per response, as Laravel does.
ini_set('session.use_cookies', '0');
ini_set('session.cache_limiter', '');
if (isset($_COOKIE['laravel_session']) && preg_match('/^[a-zA-Z0-9,-]{22,256}$/', $_COOKIE['laravel_session'])) {
    session_id($_COOKIE['laravel_session']);
}
session_start();
// Laravel sends the session cookie on every response.
setcookie(session_name(), session_id(), ['path' => '/', 'httponly' => true, 'samesite' => 'Lax']);
if (empty($_SESSION['_token'])) {
    $_SESSION['_token'] = bin2hex(random_bytes(20));
}
setcookie('XSRF-TOKEN', $_SESSION['_token'], ['path' => '/', 'samesite' => 'Lax']);

// Flash data lives for exactly one following request.
$flash = $_SESSION['_flash'] ?? [];
unset($_SESSION['_flash']);

$method = $_SERVER['REQUEST_METHOD'];
$path = parse_url($_SERVER['REQUEST_URI'], PHP_URL_PATH);
// Laravel routes by Symfony's getPathInfo(): behind nginx or Apache the
// front controller's own name, spelled as is or percent-encoded, is the
// base URL, so /index.php/contact is the route /contact.
if (preg_match('#^/index\.php(/.*)?$#', rawurldecode($path), $m)) {
    $path = $m[1] ?? '/';
}
$base = 'http://' . $_SERVER['HTTP_HOST'];

function e($s) { return htmlspecialchars((string) $s, ENT_QUOTES); }

function append_locked($file, $line) {
    $fp = fopen($file, 'a');
    flock($fp, LOCK_EX);
    fwrite($fp, $line . "\n");
    fflush($fp);
    flock($fp, LOCK_UN);
    fclose($fp);
}

function read_lines($file) {
    if (!file_exists($file)) return [];
    return array_values(array_filter(explode("\n", file_get_contents($file))));
}

if ($method === 'GET' && $path === '/contact') {
    $_SESSION['_previous_url'] = $base . '/contact';
    $old = $flash['_old_input'] ?? [];
    $errors = $flash['errors'] ?? [];
    $token = $old['submission_token'] ?? sprintf('%04x%04x-%04x-4%03x-%04x-%012x',
        random_int(0, 0xffff), random_int(0, 0xffff), random_int(0, 0xffff),
        random_int(0, 0xfff), random_int(0x8000, 0xbfff), random_int(0, 0xffffffffffff));
    header('Content-Type: text/html; charset=UTF-8');
    echo "<!doctype html><html><head><title>Kontakt</title></head><body><h1>Kontakt</h1>";
    if ($errors) {
        echo '<ul class="errors">';
        foreach ($errors as $field => $message) echo '<li>' . e($field) . ': ' . e($message) . '</li>';
        echo '</ul>';
    }
    if (!empty($flash['status'])) echo '<p class="status">' . e($flash['status']) . '</p>';
    echo '<form method="POST" action="/contact">';
    echo '<input type="hidden" name="_token" value="' . e($_SESSION['_token']) . '">';
    echo '<input type="hidden" name="submission_token" value="' . e($token) . '">';
    echo '<input type="email" name="email" id="email" value="' . e($old['email'] ?? '') . '">';
    echo '<textarea name="message" id="message">' . e($old['message'] ?? '') . '</textarea>';
    echo '<button type="submit" id="send">Anfrage senden</button></form></body></html>';
    exit;
}

if ($method === 'POST' && $path === '/contact') {
    if (!hash_equals($_SESSION['_token'], (string) ($_POST['_token'] ?? ''))) {
        http_response_code(419);
        echo 'Page Expired';
        exit;
    }
    $data = [
        'submission_token' => (string) ($_POST['submission_token'] ?? ''),
        'email' => (string) ($_POST['email'] ?? ''),
        'message' => (string) ($_POST['message'] ?? ''),
    ];
    $errors = [];
    if (!preg_match('/^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i', $data['submission_token'])) {
        $errors['submission_token'] = 'The submission token field must be a valid UUID.';
    }
    if (!filter_var($data['email'], FILTER_VALIDATE_EMAIL)) {
        $errors['email'] = 'The email field must be a valid email address.';
    }
    if ($data['message'] === '' || strlen($data['message']) > 5000) {
        $errors['message'] = 'The message field is required.';
    }
    if ($errors) {
        // $request->validate(): redirect back with errors and old input.
        $_SESSION['_flash'] = ['errors' => $errors, '_old_input' => $data];
        header('Location: ' . ($_SESSION['_previous_url'] ?? $base . '/contact'), true, 302);
        exit;
    }
    // The transaction takes a moment, so duplicates overlap.
    usleep(1000 * (int) (getenv('SUBMIT_DELAY_MS') ?: 20));
    $id = bin2hex(random_bytes(8));
    append_locked($recordsFile, json_encode(['id' => $id] + $data));
    append_locked($notificationsFile, $id);
    header('Location: ' . $base . '/contact/thanks', true, 302);
    exit;
}

if ($method === 'GET' && $path === '/contact/thanks') {
    header('Content-Type: text/html; charset=UTF-8');
    echo '<!doctype html><html><body><h1>Danke</h1></body></html>';
    exit;
}

if ($method === 'GET' && $path === '/_stats') {
    $records = array_map(fn ($l) => json_decode($l, true), read_lines($recordsFile));
    $tokens = [];
    foreach ($records as $r) $tokens[$r['submission_token']] = ($tokens[$r['submission_token']] ?? 0) + 1;
    header('Content-Type: application/json');
    echo json_encode([
        'records' => count($records),
        'notifications' => count(read_lines($notificationsFile)),
        'tokens' => (object) $tokens,
        'emails' => array_map(fn ($r) => $r['email'], $records),
    ]);
    exit;
}

http_response_code(404);
echo 'Not Found';
